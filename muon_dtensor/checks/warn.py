"""Moved to ``muon_dtensor.base.warn`` (CHANGELOG.md); this path re-exports it for one release."""

from ..base.warn import warn

__all__ = ["warn"]
