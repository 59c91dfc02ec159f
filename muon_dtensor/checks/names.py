"""Moved to ``muon_dtensor.base.names`` (CHANGELOG.md); this path re-exports it for one release."""

from ..base.names import (
    _NOT_HEADS,
    DEFAULT_HEAD_NAMES,
    DEFAULT_QKV_NAMES,
    matches,
    module_of,
    not_heads,
    param_names,
    refusal,
    strip_wrappers,
)

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_QKV_NAMES",
    "_NOT_HEADS",
    "matches",
    "module_of",
    "not_heads",
    "param_names",
    "refusal",
    "strip_wrappers",
]
