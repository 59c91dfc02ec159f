"""muon_dtensor: the Muon optimizer for plain tensors and DTensors (FSDP2, HSDP), exact and sharded.

The public names but the math load on first use (PEP 562), so ``python -m muon_dtensor plan``
imports torch and the planning modules only, not torch.distributed.tensor and the step's layers (a
second off the check).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The pure math loads at once: it checks MUON_DTENSOR_NS_BATCH at import, so a bad value stops
# every rank at ``import muon_dtensor``, before any collective.
from .base import moved  # noqa: F401  (the old module paths, importable from here on)
from .numerics.newton_schulz import DEFAULT_COEFFICIENTS, PRESETS, NSConfig, newton_schulz, orthogonalize

if TYPE_CHECKING:
    from .checks.wrong_matrix import WrongMatrixWarning
    from .features.qk_clip import QKClipFactors, qk_clip_, qk_clip_all_, qk_clip_factors
    from .numerics.ns_config import resolve_ns_config
    from .optim.optimizer import ADAMW_DEFAULTS, Muon
    from .optim.param_groups import split_params
    from .sharding.plan.build import MatrixEntry, Plan, build_plan

# public name -> the module that defines it
_WHERE = {
    "resolve_ns_config": ".numerics.ns_config",
    "QKClipFactors": ".features.qk_clip",
    "qk_clip_": ".features.qk_clip",
    "qk_clip_all_": ".features.qk_clip",
    "qk_clip_factors": ".features.qk_clip",
    "ADAMW_DEFAULTS": ".optim.optimizer",
    "Muon": ".optim.optimizer",
    "split_params": ".optim.param_groups",
    "WrongMatrixWarning": ".checks.wrong_matrix",
    "MatrixEntry": ".sharding.plan.build",
    "Plan": ".sharding.plan.build",
    "build_plan": ".sharding.plan.build",
}

__all__ = [
    "ADAMW_DEFAULTS",
    "DEFAULT_COEFFICIENTS",
    "PRESETS",
    "MatrixEntry",
    "Muon",
    "NSConfig",
    "Plan",
    "QKClipFactors",
    "WrongMatrixWarning",
    "build_plan",
    "newton_schulz",
    "orthogonalize",
    "qk_clip_",
    "qk_clip_all_",
    "qk_clip_factors",
    "resolve_ns_config",
    "split_params",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


# The package's version, in this one place: pyproject.toml reads it (`[tool.setuptools.dynamic]`).
__version__ = "0.5.0"
