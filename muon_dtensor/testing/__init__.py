"""Running a function on local ranks, for tests, benchmarks and demos, as ``torch.testing`` is
public: ``run_ranks`` starts fresh processes (``runner.py``), on Linux without GPUs forked from a
launcher that imported torch once (``launcher.py``, whose building blocks a fork server of one's own
can reuse), each running ``rank.py``'s worker. Moved here from ``muon_dtensor.tools`` in 0.6.0.
Row ``testing/`` of docs/design.md's layer table.

The names load on first use: the launcher and the rank run as ``python -m`` modules of this package,
which must not be imported before they run."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = globals()[name] = getattr(importlib.import_module(".runner", __name__), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
