"""The one error every checkpoint reader raises (kept apart so that every module can import it)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete, edited or of another model."""
