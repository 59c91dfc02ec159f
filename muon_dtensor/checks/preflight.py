"""The preflight: checks that depend on per-rank data (is there a gradient, is it sparse, is it laid
out like its parameter), as flags that ``step_checks.py`` sums over ranks before any other collective
of a step, so every rank raises the same error, naming the parameter, before any data moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.compat import local_tensor
from ..base.torch_dist import dtensor_spec
from ..base.torch_ops import disable_torch_function
from ..sharding.plan.param_layout import same_layout

__all__ = ["PreflightItem", "layout_text", "local_flags", "presence", "raise_for"]


@dataclass(frozen=True)
class PreflightItem:
    name: str
    param: Tensor
    grad: Tensor | None
    # Who must agree on this parameter's gradient: a DeviceMesh, a ProcessGroup (DDP), or None.
    scope: Any = None


def local_flags(params: Sequence[Tensor]) -> Tensor:
    """Per parameter (present, sparse, mislaid) as 0/1, ``[n, 3]``: built as one flat list of Python
    ints, one tensor at the end. The loop runs for every parameter of every step, so its common
    case (a dense gradient built with its parameter's DTensor spec, as FSDP2 makes them) is first
    and short."""
    flat: list[int] = []
    for p in params:
        grad: Any = p.grad  # a DTensor's attributes below: read directly, the checks say when
        if grad is None:
            flat += _ABSENT
        elif grad.is_sparse:
            flat += _SPARSE
        elif (
            (spec := dtensor_spec(grad)) is not None
            and spec is dtensor_spec(p)
            and (local_tensor(grad).shape == local_tensor(p).shape)
        ):
            flat += _PRESENT
        else:
            flat += (1, 0, int(not same_layout(p, grad)))
    return torch.tensor(flat, dtype=torch.int64).view(len(params), 3)


_ABSENT, _SPARSE, _PRESENT = (0, 0, 0), (1, 1, 0), (1, 0, 0)
_NOT_A_SPEC = object()  # a plain parameter's stand-in spec: no gradient's ``_spec`` is it


def specs_of(params: Sequence[Tensor]) -> tuple[tuple[Any, Any], ...]:
    """Per parameter, its DTensor spec and local shape as now (what ``presence`` compares a
    gradient with; cached with the parameters, so a steady step reads none of them again)."""
    return tuple(
        (dtensor_spec(p), local_tensor(p).shape) if isinstance(p, DTensor) else (_NOT_A_SPEC, None)
        for p in params
    )


def presence(params: Sequence[Tensor], specs: Sequence[tuple[Any, Any]]) -> tuple[bytes, int]:
    """Per parameter 1 if it has a gradient, and how many gradients are sparse or laid out unlike
    their parameter (``local_flags`` says which): the steady step's short form of the flags. A
    gradient built with its parameter's own spec and local shape (FSDP2's) is the first case."""
    with disable_torch_function():  # ``.grad`` without DTensor's torch-function check: half the cost
        grads: list[Any] = [p.grad for p in params]
    bits, bad = bytearray(len(params)), 0
    for i, (grad, (spec, shape)) in enumerate(zip(grads, specs)):
        if grad is None:
            continue
        bits[i] = 1
        if dtensor_spec(grad) is spec and local_tensor(grad).shape == shape:
            continue
        bad += int(grad.is_sparse or not same_layout(params[i], grad))
    return bytes(bits), bad


def layout_text(t: Tensor | None) -> str:
    if isinstance(t, DTensor):
        return f"DTensor {tuple(t.shape)} {tuple(t.placements)}"
    return "None" if t is None else f"plain tensor {tuple(t.shape)}"


def raise_for(item: PreflightItem, row: Sequence[int], ranks: int) -> None:
    present, sparse, mislaid = (int(v) for v in row)
    where = f"on {{}} of {ranks} rank(s)"
    if sparse:
        raise RuntimeError(
            f"Muon does not support sparse gradients: '{item.name}' has one {where.format(sparse)}; "
            "use a dense gradient (e.g. nn.Embedding(sparse=False))"
        )
    if mislaid:
        raise ValueError(
            f"the gradient of '{item.name}' is not laid out like the parameter "
            f"{where.format(mislaid)} (parameter: {layout_text(item.param)}, gradient here: "
            f"{layout_text(item.grad)}); reduce or redistribute the gradient to the parameter's "
            "placements before step() (a Partial gradient must be reduced first)"
        )
    if item.scope is not None and 0 < present < ranks:
        raise RuntimeError(
            f"'{item.name}' has a gradient {where.format(present)}; a sharded parameter needs a "
            "gradient on every rank or on none. Make every rank run the same forward and backward, "
            "or zero_grad(set_to_none=False) so missing gradients become zeros everywhere"
        )
