"""Checks of the parameters a group holds: their dimensions for the group's algorithm, their
placements, their row blocks (``split_sizes``, ``head_dim``) and NorMuon's rows. They read global
shapes and placements only, which every rank shares, so every rank raises the same error with no
communication."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.compat import StridedShard
from ..base.names import not_heads
from ..base.torch_dist import capturable_devices
from ..base.warn import warn
from ..numerics.blockwise import BLOCK, absmax_shape, block_problem
from ..sharding.plan.blocks import shard_blocks
from ..sharding.plan.param_layout import check_placements, local_of, shards_of

__all__ = ["check_params", "check_switched"]


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


def _check_split_sizes(p: Tensor, name: str, group: Mapping[str, Any]) -> None:
    split_sizes, head_dim = group.get("split_sizes"), group.get("head_dim")
    rows = p.shape[1] if group.get("experts", False) and p.ndim == 3 else p.shape[0]
    if split_sizes and (sum(split_sizes) != rows or min(split_sizes) <= 0):
        raise ValueError(
            f"split_sizes {list(split_sizes)} of '{name}' must be positive and sum to its {rows} rows"
        )
    if head_dim is None:
        return
    blocks = list(split_sizes) if split_sizes else [rows]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim of '{name}' must be a positive int (rows per head) but is: {head_dim!r}")
    if any(size % head_dim for size in blocks):
        raise ValueError(
            f"head_dim {head_dim} does not divide the row blocks {blocks} of '{name}'; give its "
            "attention projections (rows = heads * head_dim) a param group of their own"
        )


def check_params(group: Mapping[str, Any], names: Sequence[str]) -> None:
    """Each parameter fits its group's algorithm. A group may mix meshes (and plain tensors): each
    exchange group gets its own plan."""
    muon = group["algorithm"] == "muon"
    for p, name in zip(group["params"], names):
        _check_param(p, name, muon, group.get("flatten", False), group.get("experts", False))
        if muon:
            check_placements(p, name)
            _check_split_sizes(p, name, group)
            if group.get("normuon", False):
                _check_normuon_param(p, name, group)
    check_int8_layouts(group, names)
    if muon and group.get("head_dim") and (suspects := not_heads(names)):
        warn(
            f"head_dim={group['head_dim']} is set on a group holding {suspects}, whose rows are not "
            "attention heads (an output projection or MLP): each block of head_dim rows is "
            "orthogonalized alone, which changes their update. Put only the q, k, v projections in "
            "the head_dim group: split_params(model, head_dim=d) builds it",
            every_rank=True,
        )


def _check_normuon_param(p: Tensor, name: str, group: Mapping[str, Any]) -> None:
    """NorMuon keeps one value per row of a 2-D matrix or an expert's: a flattened conv weight has
    no such rows in the state's layout, and an interleaved last dimension has no single first column."""
    if group.get("flatten", False) and p.ndim > 2 and not (group.get("experts", False) and p.ndim == 3):
        raise ValueError(
            f"parameter '{name}' of shape {tuple(p.shape)} would be flattened, which NorMuon does not support "
            "(its second moment is one value per row of a 2-D or expert matrix); put it in a group "
            "without 'normuon' or without 'flatten'"
        )
    placements = tuple(p.placements) if isinstance(p, DTensor) else ()
    if any(isinstance(q, StridedShard) and q.dim == p.ndim - 1 for q in placements):
        raise ValueError(
            f"parameter '{name}' has placements {placements}: NorMuon needs its last dimension "
            "sharded by Shard, not interleaved by _StridedShard; shard that dimension with Shard or "
            "put the parameter in a group without 'normuon'"
        )


def check_switched(group: Mapping[str, Any], names: Sequence[str]) -> None:
    """The parameter checks of settings a group may switch after construction, run by the step's
    local checks whenever they change (their failure raised on every rank together): an int8
    group's layouts, before its buffers convert, and a capturable group's devices (at construction
    a rank that alone passed ``capturable=True`` would raise alone, its peers waiting in the step)."""
    check_int8_layouts(group, names)
    if group.get("capturable", False) is True:
        for p, name in zip(group["params"], names):
            _check_capturable_param(p, name, group["lr"])


def check_int8_layouts(group: Mapping[str, Any], names: Sequence[str]) -> None:
    """``_int8_problem`` for each parameter of an int8-momentum group, every refused one named in one
    error, so one fix covers them all."""
    if group["algorithm"] == "muon" and group.get("momentum_dtype") == "int8":
        refused = [m for p, name in zip(group["params"], names) if (m := _int8_problem(p, name))]
        if len(refused) == 1:
            raise ValueError(refused[0])
        if refused:
            raise ValueError(
                f"{len(refused)} parameters cannot keep momentum_dtype=torch.int8:\n"
                + "\n".join(f"- {m}" for m in refused)
            )


def _int8_problem(p: Tensor, name: str) -> str | None:
    """Why int8 momentum cannot hold ``p``, or None. It keeps blocks of ``BLOCK`` columns whole on
    every shard, with each shard's block maxima laid out as its blocks (``block_state_zeros``): a
    shard of the last dimension must start on a block and end on one (or at the row's end)."""
    if not isinstance(p, DTensor):
        return None
    placements, last = tuple(p.placements), p.ndim - 1
    fix = (
        f"give that dimension ({p.shape[-1]} columns) shards of a multiple of {BLOCK} columns, or "
        "put the parameter in a group with a float momentum_dtype"
    )
    if any(isinstance(q, StridedShard) and q.dim == last for q in placements):
        return (
            f"parameter '{name}' has placements {placements}: momentum_dtype=torch.int8 needs its last "
            f"dimension sharded by Shard, not interleaved by _StridedShard; {fix}"
        )
    shards = [s for s in shards_of(p, name)]
    if not any(s.dim == last for s in shards):
        return None
    values, maxima = shard_blocks(p.shape, shards), shard_blocks(absmax_shape(p.shape), shards)
    for block, scales in zip(values, maxima):
        (start, end), (lo, hi) = block[last][0], scales[last][0]
        problem = block_problem(int(p.shape[-1]), [(start, end)])
        if problem is None and (lo, hi) != (start // BLOCK, -(-end // BLOCK)) and start < end:
            problem = f"its block maxima would not be laid out as the shard holding columns [{start}, {end})"
        if problem is not None:
            return f"parameter '{name}' has placements {placements}: {problem}; {fix}"
    return None


def _check_capturable_param(p: Tensor, name: str, lr: Any) -> None:
    """``capturable=True`` keeps the step's scalars on the parameters' device for a CUDA graph: the
    device must be one torch captures on (its capturable AdamW's list), a tensor lr on it too."""
    supported = capturable_devices()
    device = local_of(p).device
    if device.type not in supported:
        raise ValueError(
            f"parameter '{name}' is on {device}, but capturable=True is for parameters on a device "
            f"torch captures graphs on ({', '.join(supported)}); set capturable=False for its group"
        )
    if isinstance(lr, Tensor) and lr.device != device:
        raise ValueError(
            f"parameter '{name}' is on {device} and its capturable group's tensor lr on {lr.device}: "
            "a graph cannot read a scalar from another device; create the lr tensor on the parameters' device"
        )
