"""Moved to ``muon_dtensor.base.compat`` (CHANGELOG.md); this path re-exports it for one release."""

from ...base.compat import StridedShard as _StridedShard
from ...base.compat import flatten_state_dict, has_cpu_backend, local_tensor

__all__ = ["_StridedShard", "flatten_state_dict", "has_cpu_backend", "local_tensor"]
