"""muon_dtensor: the Muon optimizer for plain tensors and DTensors (FSDP2, HSDP), exact and sharded."""

from __future__ import annotations

from .checks.validation import resolve_ns_config
from .features.qk_clip import QKClipFactors, qk_clip_, qk_clip_all_, qk_clip_factors
from .numerics.newton_schulz import DEFAULT_COEFFICIENTS, PRESETS, NSConfig, newton_schulz, orthogonalize
from .optim.optimizer import ADAMW_DEFAULTS, Muon
from .optim.param_groups import split_params
from .sharding.plan.build import MatrixEntry, Plan, build_plan

__all__ = [
    "ADAMW_DEFAULTS",
    "DEFAULT_COEFFICIENTS",
    "PRESETS",
    "MatrixEntry",
    "Muon",
    "NSConfig",
    "Plan",
    "QKClipFactors",
    "build_plan",
    "newton_schulz",
    "orthogonalize",
    "qk_clip_",
    "qk_clip_all_",
    "qk_clip_factors",
    "resolve_ns_config",
    "split_params",
]

# The package's version, in this one place: pyproject.toml reads it (`[tool.setuptools.dynamic]`).
__version__ = "0.3.0"
