"""torch's private tensor-level names the math uses, looked up here and nowhere else
(``tests/base/test_private_torch.py`` holds the package to it): the multi-tensor ops ``torch._foreach_*``
(private by name, the kernels torch.optim's own foreach steps run) and the switch that reads a
DTensor's attribute without its torch-function check. No ``torch.distributed`` import, so
``numerics/`` may use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "disable_torch_function",
    "foreach_add_",
    "foreach_copy_",
    "foreach_div",
    "foreach_mul",
    "foreach_mul_",
    "foreach_norm",
    "foreach_scalar_op",
    "foreach_sqrt",
    "foreach_sub_",
]

foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_
foreach_div = torch._foreach_div
foreach_mul = torch._foreach_mul
foreach_mul_ = torch._foreach_mul_
foreach_norm = torch._foreach_norm
foreach_sqrt = torch._foreach_sqrt
foreach_sub_ = torch._foreach_sub_


def foreach_scalar_op(name: str, *, inplace: bool) -> Callable[..., Any]:
    """``torch._foreach_<name>`` (``_<name>_`` in place), e.g. ``foreach_scalar_op("mul", inplace=True)``."""
    op: Callable[..., Any] = getattr(torch, f"_foreach_{name}_" if inplace else f"_foreach_{name}")
    return op


def disable_torch_function() -> Any:
    """``torch._C.DisableTorchFunction()``: a context in which a tensor subclass's attributes (a
    DTensor's ``.grad``) are read without its ``__torch_function__`` check."""
    return torch._C.DisableTorchFunction()
