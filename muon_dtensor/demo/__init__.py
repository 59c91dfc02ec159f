"""The main job: ``python -m muon_dtensor demo`` (``run``, training in ``train``, its ``report``,
per-N-steps ``log`` line, ``progress`` and CPU probe ``cpu``); also the ``model``, ``data``, meshes (``parallel``), QK-Clip
wiring (``qk_clip``, ``logits``) and the round-robin double (``round_robin``) that
``examples/train.py`` and the tests reuse. Row ``demo/`` of docs/design.md's layer table."""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from .run import main as run_main  # lazy: ranks import the submodules without the CLI

    return run_main(argv)
