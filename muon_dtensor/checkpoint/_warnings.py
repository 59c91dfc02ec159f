"""DCP's single-process warning, hidden where one process is the intent."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

__all__ = ["SINGLE_PROCESS", "single_process"]

# torch.distributed.checkpoint's save and load say this whenever no process group is up (torch 2.9+).
SINGLE_PROCESS = (
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
    r"assuming the intent is to (save|load) in a single process"
)


@contextlib.contextmanager
def single_process(solo: bool = True) -> Iterator[None]:
    """Hide exactly DCP's single-process warning inside the block when ``solo``; other warnings pass."""
    if not solo:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS, category=UserWarning)
        yield
