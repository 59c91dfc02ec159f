"""The main job: ``python -m muon_dtensor demo`` (see ``run.py``); also the model, data and
round-robin double that ``examples/train.py`` and the tests reuse."""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .run import main as run_main  # lazy: ranks import the submodules without the CLI

    return run_main(argv)
