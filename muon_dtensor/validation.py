"""Input checks. Local checks depend only on metadata every rank shares (hyperparameters, global
shapes, placements), so every rank raises the same error with no communication. Checks that depend
on per-rank data (is there a gradient, is it sparse, is it laid out like its parameter) go through
one small all-reduce, the preflight, before any other collective of a step; then every rank raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._sharding.comm import sum_over_group, sum_over_mesh
from ._sharding.param_layout import same_layout

__all__ = ["PreflightItem", "check_adamw_group", "check_muon_group", "check_muon_param", "preflight"]

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def _check_lr(lr: float | Tensor) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")


def check_muon_group(group: Mapping) -> None:
    """torch.optim.Muon's argument checks, with its messages."""
    _check_lr(group["lr"])
    if not group["momentum"] >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if group.get("mode", "owner") not in ("owner", "gather"):
        raise ValueError(f"mode should be 'owner' or 'gather' but is: {group['mode']!r}")


def check_adamw_group(group: Mapping) -> None:
    """torch.optim.AdamW's argument checks, with its messages."""
    _check_lr(group["lr"])
    if not group["eps"] >= 0.0:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    beta1, beta2 = group["betas"]
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")


def check_param(p: Tensor, name: str) -> None:
    if torch.is_complex(p):
        raise RuntimeError(
            f"Muon does not support complex parameters: '{name}' is {p.dtype}; "
            "view it as real (torch.view_as_real) or keep it out of the optimizer"
        )


def check_muon_param(p: Tensor, name: str, *, flatten: bool = False, experts: bool = False) -> None:
    check_param(p, name)
    if p.ndim == 2 or (flatten and p.ndim > 2) or (experts and p.ndim == 3):
        return
    raise ValueError(
        f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
        f"('{name}'). For a conv weight set \"flatten\": True in its param group; for stacked "
        'expert weights [E, m, n] set "experts": True; otherwise put it in a group with '
        '"algorithm": "adamw" (muon_dtensor.split_params does this for a model)'
    )


@dataclass(frozen=True)
class PreflightItem:
    name: str
    param: Tensor
    grad: Tensor | None
    # Who must agree on this parameter's gradient: a DeviceMesh, a ProcessGroup (DDP), or None.
    scope: Any = None


# Columns of the preflight count matrix, summed over ranks.
_PRESENT, _SPARSE, _MISLAID = 0, 1, 2


def _local_flags(items: Sequence[PreflightItem]) -> Tensor:
    flags = torch.zeros(len(items), 3, dtype=torch.int32)
    for i, item in enumerate(items):
        if item.grad is None:
            continue
        flags[i, _PRESENT] = 1
        if item.grad.is_sparse:
            flags[i, _SPARSE] = 1
        elif not same_layout(item.param, item.grad):
            flags[i, _MISLAID] = 1
    return flags


def _layout_text(t: Tensor | None) -> str:
    if isinstance(t, DTensor):
        return f"DTensor {tuple(t.shape)} {tuple(t.placements)}"
    return "None" if t is None else f"plain tensor {tuple(t.shape)}"


def _raise_for(item: PreflightItem, row: Tensor, ranks: int) -> None:
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
            f"{where.format(mislaid)} (parameter: {_layout_text(item.param)}, gradient here: "
            f"{_layout_text(item.grad)}); reduce or redistribute the gradient to the parameter's "
            "placements before step() (a Partial gradient must be reduced first)"
        )
    if item.scope is not None and 0 < present < ranks:
        raise RuntimeError(
            f"'{item.name}' has a gradient {where.format(present)}; a sharded parameter needs a "
            "gradient on every rank or on none. Make every rank run the same forward and backward, "
            "or zero_grad(set_to_none=False) so missing gradients become zeros everywhere"
        )


def _sum(flags: Tensor, scope: Any) -> tuple[Tensor, int]:
    if isinstance(scope, DeviceMesh):
        return sum_over_mesh(flags, scope), scope.size()
    import torch.distributed as dist

    return sum_over_group(flags, scope), dist.get_world_size(scope)


def preflight(items: Sequence[PreflightItem]) -> list[bool]:
    """Check every parameter on every rank; return which ones have a gradient to apply.

    One all-reduce per axis of every mesh (and per DDP group) in use shares the per-rank facts;
    then all ranks decide the same way. Raises on every rank if any rank's input is bad.
    """
    flags = _local_flags(items)
    scopes: list[Any] = []
    for item in items:
        if item.scope is not None and item.scope not in scopes:
            scopes.append(item.scope)
    totals = [_sum(flags, scope) for scope in scopes]
    # A parameter that no collective involves still must not fail on one rank alone.
    any_bad = flags[:, 1:].clone()
    for summed, _ in totals:
        any_bad = torch.maximum(any_bad, summed[:, 1:])
    widest = max((size for _, size in totals), default=1)
    present: list[bool] = []
    for i, item in enumerate(items):
        if item.scope is not None:
            summed, ranks = totals[scopes.index(item.scope)]
            row = summed[i]
        else:
            row, ranks = torch.cat([flags[i, :1], any_bad[i]]), widest
        _raise_for(item, row, ranks)
        present.append(bool(row[_PRESENT] > 0))
    return present
