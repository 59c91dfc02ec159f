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

from ..sharding.plan.compat import _StridedShard
from ..sharding.plan.param_layout import check_placements
from .names import not_heads
from .warn import warn

__all__ = ["check_params"]


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
    if any(isinstance(q, _StridedShard) and q.dim == p.ndim - 1 for q in placements):
        raise ValueError(
            f"parameter '{name}' has placements {placements}: NorMuon needs its last dimension "
            "sharded by Shard, not interleaved by _StridedShard; shard that dimension with Shard or "
            "put the parameter in a group without 'normuon'"
        )
