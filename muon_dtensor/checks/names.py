"""Moved to ``muon_dtensor.base.names`` (CHANGELOG.md); this path re-exports it for one release."""

from ..base.names import *  # noqa: F403
from ..base.names import __all__ as __all__
