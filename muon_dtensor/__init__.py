"""muon_dtensor: the Muon optimizer for plain tensors and DTensors (FSDP2, HSDP), exact and sharded."""

from __future__ import annotations

from .newton_schulz import DEFAULT_COEFFICIENTS, PRESETS, NSConfig, newton_schulz, resolve_ns_config
from .optimizer import ADAMW_DEFAULTS, Muon
from .param_groups import split_params
from ._sharding.plan import Plan, build_plan

__all__ = [
    "ADAMW_DEFAULTS",
    "DEFAULT_COEFFICIENTS",
    "Muon",
    "NSConfig",
    "PRESETS",
    "Plan",
    "build_plan",
    "newton_schulz",
    "resolve_ns_config",
    "split_params",
]

__version__ = "0.1.0"
