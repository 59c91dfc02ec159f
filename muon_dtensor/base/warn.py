"""Warnings where the user is: at the first frame outside the package (the user's ``opt.step()`` or
``load_checkpoint``, not a line of ours), and once per job where every rank would say the same."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["warn"]

# Ours, and torch's (its optimizer wraps ``step`` in hooks and ``no_grad``): never the user's line.
_SKIPPED = (str(Path(__file__).resolve().parent.parent), str(Path(torch.__file__).resolve().parent))


def warn(message: str, category: type[Warning] = UserWarning, *, every_rank: bool = False) -> None:
    """``warnings.warn`` at the user's line; on rank 0 alone unless ``every_rank`` (a warning that
    depends on this rank's own parameters, which another rank would not print)."""
    if not every_rank and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    warnings.warn(message, category, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first caller outside the package and torch, seen from ``warn``."""
    frame: FrameType | None = sys._getframe(2)
    level = 2  # stacklevel 2 is the frame that called warn()
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level
