"""Python scalars for CPU multi-tensor ops, as 0-dim tensors of the list's dtype: pure math.

torch's CPU ``_foreach_*`` ops loop over their list, and a Python scalar is wrapped and cast once per
tensor; for thousands of small tensors that costs several times the arithmetic (docs/benchmarks.md,
"The steady step's work per tensor"). A 0-dim tensor of the list's dtype is read as it is, and the
kernel rounds a Python scalar to that dtype too, so the bits are the same
(tests/numerics/test_cpu_scalars.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["scalar_of", "scalars_of"]

# Per thread and dtype: a 0-dim CPU tensor and a NumPy view of it, made once. A scalar is written
# through the view just before the one op that reads it: no torch op per step (a tensor made from a
# changing value, such as AdamW's bias correction, would add host ops to every step).
_SCRATCH = threading.local()


def _cpu_scalar(value: float, dtype: torch.dtype) -> Tensor:
    """The thread's 0-dim CPU tensor of ``dtype``, now holding ``value`` (rounded to ``dtype`` as a C
    cast rounds it); valid until the next call, so the caller passes it straight to one op."""
    made: dict[torch.dtype, tuple[Tensor, Any]] = getattr(_SCRATCH, "made", None) or {}
    _SCRATCH.made = made
    if dtype not in made:
        t = torch.zeros((), dtype=dtype)
        made[dtype] = (t, t.numpy())
    tensor, view = made[dtype]
    view[()] = value
    return tensor


def scalar_of(tensors: Sequence[Tensor], value: float) -> float | Tensor:
    """``value`` as the one multi-tensor op about to run on ``tensors`` should take it. A CPU list of
    one dtype, float32 or float64, takes a 0-dim tensor of that dtype: the kernel rounds a Python
    scalar to the list's dtype as well, so the bits are the same (tests/numerics/test_cpu_scalars.py),
    but it wraps and casts a Python scalar once per tensor, several times the multiply of a small one."""
    if not tensors or tensors[0].device.type != "cpu":
        return value
    dtype = tensors[0].dtype
    if dtype not in (torch.float32, torch.float64) or any(t.dtype != dtype for t in tensors):
        return value
    return _cpu_scalar(float(value), dtype)


def scalars_of(tensors: list[Tensor], values: list[float]) -> list[float] | Tensor:
    """``scalar_of`` for per-tensor scalars: one tensor where they are all equal (zeros, equal
    whatever their sign, stay floats), else the floats."""
    if not values or values[0] == 0.0 or any(v != values[0] for v in values):
        return values
    one = scalar_of(tensors, values[0])
    return one if isinstance(one, Tensor) else values
