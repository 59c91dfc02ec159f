"""Every input check, once. Local checks depend only on metadata every rank shares (hyperparameters,
global shapes, placements), so every rank raises the same error with no communication. Checks that
depend on per-rank data (is there a gradient, is it sparse, is it laid out like its parameter) go
through one small all-reduce, the preflight, before any other collective of a step; then every rank
raises. Messages are torch.optim's where torch has the same check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._sharding.comm import sum_over_scopes
from ._sharding.param_layout import same_layout
from .elementwise import ADJUST_LR
from .newton_schulz import PRESETS, NSConfig, Triple

__all__ = [
    "MODES",
    "PreflightItem",
    "check_adamw_group",
    "check_algorithm",
    "check_group",
    "check_mode",
    "check_muon_group",
    "check_params",
    "ns_dtype_name",
    "param_names",
    "preflight",
    "resolve_ns_config",
]

MODES = ("owner", "gather")
_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _check_lr(lr: float | Tensor) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")


def check_algorithm(group: dict[str, Any]) -> str:
    """A param group's algorithm, ``"muon"`` when unset."""
    algorithm = group.setdefault("algorithm", "muon")
    if algorithm not in ("muon", "adamw"):
        raise ValueError(f"algorithm should be 'muon' or 'adamw' but is: {algorithm!r}")
    return algorithm


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode should be 'owner' or 'gather' but is: {mode!r}")


def ns_dtype_name(dtype: torch.dtype | str) -> str:
    """``ns_dtype`` as the name a param group stores (plain data in ``state_dict``)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in _NS_DTYPES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32 but is: {dtype}")
    return name


def check_muon_group(group: Mapping[str, Any]) -> NSConfig:
    """torch.optim.Muon's argument checks, with its messages, and ours; returns the NS config."""
    _check_lr(group["lr"])
    if not group["momentum"] >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    if group["adjust_lr_fn"] not in ADJUST_LR:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    check_mode(group.get("mode", "owner"))
    dtype = _NS_DTYPES[ns_dtype_name(group.get("ns_dtype", "bfloat16"))]
    return resolve_ns_config(group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)


def check_group(group: Mapping[str, Any]) -> NSConfig | None:
    """A group's hyperparameters (a user or scheduler may change them between steps); a Muon
    group's Newton-Schulz config, None for AdamW."""
    if group["algorithm"] == "adamw":
        check_adamw_group(group)
        return None
    return check_muon_group(group)


def check_adamw_group(group: Mapping[str, Any]) -> None:
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


def _as_triple(value: Sequence[float]) -> Triple:
    if len(value) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = (float(v) for v in value)
    return (a, b, c)


def resolve_ns_config(
    ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> NSConfig:
    """Turn the user's ``ns_coefficients`` (a triple, a per-step list or a preset name) into a config.

    A fixed triple is used for all ``ns_steps`` iterations. A per-step list is used in order; when
    ``ns_steps`` is longer than the list, its last triple repeats (as microsoft/dion does).
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if ns_steps < 0:
        raise ValueError(f"ns_steps should be >= 0 but is: {ns_steps}")
    ns_dtype_name(dtype)
    norm_scale = 1.0
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in PRESETS:
            raise ValueError(
                f"Unknown ns_coefficients preset {ns_coefficients!r}; "
                f"use one of {sorted(PRESETS)} or a tuple (a, b, c)"
            )
        steps, norm_scale = PRESETS[ns_coefficients]
    elif len(ns_coefficients) > 0 and isinstance(ns_coefficients[0], (int, float)):
        steps = (_as_triple(ns_coefficients),)  # type: ignore[arg-type]
    else:
        steps = tuple(_as_triple(t) for t in ns_coefficients)  # type: ignore[arg-type]
        if not steps:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
    per_step = tuple(steps[min(i, len(steps) - 1)] for i in range(ns_steps))
    return NSConfig(per_step, eps=float(eps), norm_scale=norm_scale, dtype=dtype)


def _check_param(p: Tensor, name: str, muon: bool, flatten: bool, experts: bool) -> None:
    if torch.is_complex(p):
        raise RuntimeError(
            f"Muon does not support complex parameters: '{name}' is {p.dtype}; "
            "view it as real (torch.view_as_real) or keep it out of the optimizer"
        )
    if not muon or p.ndim == 2 or (flatten and p.ndim > 2) or (experts and p.ndim == 3):
        return
    raise ValueError(
        f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()} "
        f"('{name}'). For a conv weight set \"flatten\": True in its param group; for stacked "
        'expert weights [E, m, n] set "experts": True; otherwise put it in a group with '
        '"algorithm": "adamw" (muon_dtensor.split_params does this for a model)'
    )


def check_params(group: Mapping[str, Any], names: Sequence[str]) -> None:
    """Each parameter fits its group's algorithm, and a Muon group lives on one mesh."""
    meshes: dict[Any, str] = {}
    muon = group["algorithm"] == "muon"
    for p, name in zip(group["params"], names):
        meshes.setdefault(p.device_mesh if isinstance(p, DTensor) else None, name)
        _check_param(p, name, muon, group.get("flatten", False), group.get("experts", False))
    if len(meshes) > 1:
        found = ", ".join(f"'{n}' on {m or 'no mesh (a plain tensor)'}" for m, n in meshes.items())
        raise ValueError(
            f"one param group holds parameters on different meshes ({found}); "
            "put the parameters of each mesh in a param group of their own"
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


def _present(items: Sequence[PreflightItem]) -> list[bool]:
    flags = _local_flags(items)
    scopes: list[Any] = []
    for item in items:
        if item.scope is not None and item.scope not in scopes:
            scopes.append(item.scope)
    totals = sum_over_scopes(flags, scopes)
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


def param_names(group: Mapping[str, Any], index: int) -> list[str]:
    """The names errors use: a group's ``param_names`` (FQNs from named parameters), or positions."""
    if "param_names" in group:
        return list(group["param_names"])
    return [f"param_groups[{index}]['params'][{i}]" for i in range(len(group["params"]))]


def preflight(groups: Sequence[Mapping[str, Any]], ddp_group: Any = None) -> list[list[int]]:
    """Check every parameter on every rank; return, per group, the indices of the parameters with a
    gradient to apply. Who must agree about a gradient: its mesh, the DDP group (Muon groups), or
    nobody. One all-reduce per axis of every mesh (and per DDP group) in use shares the per-rank
    facts; then all ranks decide the same way, and raise on every rank if any rank's input is bad."""
    items = [
        PreflightItem(name, p, p.grad, p.device_mesh if isinstance(p, DTensor) else ddp)
        for index, group in enumerate(groups)
        for ddp in [ddp_group if group["algorithm"] == "muon" else None]
        for p, name in zip(group["params"], param_names(group, index))
    ]
    present = iter(_present(items))
    return [[i for i in range(len(group["params"])) if next(present)] for group in groups]
