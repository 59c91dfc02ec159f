"""Read a parameter's layout (plain tensor or DTensor) into the layout module's plain data."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .layout import AxisShard, Block, block_shape, full_block, shard_blocks

__all__ = ["ParamLayout", "describe", "local_of"]


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter lives. ``axis`` is the one mesh axis that shards it (None: every rank of
    the mesh, or this process alone, holds it whole); ``blocks`` has one block per rank of that axis."""

    mesh: DeviceMesh | None
    axis: int | None
    blocks: tuple[Block, ...]
    rank: int  # this process's index along ``axis`` (0 when axis is None)

    @property
    def group_size(self) -> int:
        return len(self.blocks)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, the tensor itself otherwise (shares memory either way)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _unsupported(name: str, p: DTensor, why: str) -> ValueError:
    return ValueError(
        f"parameter '{name}' has placements {tuple(p.placements)} on mesh {p.device_mesh}: {why}. "
        "muon_dtensor supports Replicate and Shard(dim) on a single sharded mesh axis (FSDP2 and "
        "HSDP); redistribute the parameter or put it in an AdamW group"
    )


def describe(p: Tensor, name: str) -> ParamLayout:
    """The layout of parameter ``p``; raises ValueError naming ``name`` for layouts not handled."""
    if not isinstance(p, DTensor):
        return ParamLayout(None, None, (full_block(p.shape),), 0)
    mesh = p.device_mesh
    shards: list[AxisShard] = []
    for axis, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise _unsupported(name, p, f"placement {placement} on mesh axis {axis}")
        shards.append(AxisShard(axis=axis, dim=placement.dim, size=mesh.size(axis)))
    if len(shards) > 1:
        raise _unsupported(name, p, "it is sharded on more than one mesh axis")
    axis = shards[0].axis if shards else None
    blocks = shard_blocks(p.shape, shards) if shards else (full_block(p.shape),)
    rank = mesh.get_local_rank(axis) if axis is not None else 0
    local_shape = tuple(p.to_local().shape)
    if block_shape(blocks[rank]) != local_shape:
        raise _unsupported(name, p, f"its local shape {local_shape} is not the expected chunk")
    return ParamLayout(mesh, axis, blocks, rank)


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether gradient ``b`` is laid out like parameter ``a`` (same kind, mesh, placements, shape)."""
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor):
        assert isinstance(b, DTensor)
        return (
            a.device_mesh == b.device_mesh
            and tuple(a.placements) == tuple(b.placements)
            and a.shape == b.shape
            and a.to_local().shape == b.to_local().shape
        )
    return a.shape == b.shape and torch.device(a.device) == torch.device(b.device)
