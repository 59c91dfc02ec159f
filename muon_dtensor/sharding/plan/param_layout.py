"""Read a parameter's layout (plain tensor or DTensor) into the layout module's plain data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros

from ...base.compat import StridedShard, local_tensor
from ...base.torch_dist import dtensor_spec
from ...numerics.blockwise import absmax_shape
from .blocks import AxisShard, Block, block_numel, block_shape, full_block, mesh_blocks, shard_blocks

__all__ = [
    "check_placements",
    "ParamLayout",
    "describe",
    "exchange_axes",
    "relayout",
    "replica_count",
    "row_state_zeros",
    "block_state_zeros",
    "local_grad",
    "local_of",
    "same_layout",
    "shards_of",
]


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter lives. ``axes`` are the mesh axes whose ranks exchange its blocks (the
    sharded ones; every axis for a fully replicated parameter, or with owners over the whole mesh);
    ``blocks`` has one block per rank of the exchange group, in group-rank order; ``rank`` is this
    process's group rank. ``replica_of`` is set when the group spans replicas (HSDP with owners over
    the mesh): per group rank, the replica it belongs to (see ``blocks.mesh_blocks``)."""

    mesh: DeviceMesh | None
    axes: tuple[int, ...]
    blocks: tuple[Block, ...]
    rank: int
    group: dist.ProcessGroup | None
    replica_of: tuple[int, ...] | None = None
    members: tuple[int, ...] = ()  # the group's global ranks, for a layout planned without its group

    @property
    def group_size(self) -> int:
        return len(self.blocks)

    @property
    def key(self) -> tuple:
        """Parameters with equal keys share an exchange group (and a plan)."""
        return (id(self.group), self.group_size, self.members)


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, the tensor itself otherwise (shares memory either way)."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def local_grad(p: Tensor) -> Tensor:
    """The local gradient of ``p``, shaped like the local parameter (an empty FSDP2 piece may be
    (0, 0) on one and (n, 0) on the other)."""
    assert p.grad is not None, "the preflight steps only parameters with a gradient"
    grad, param = local_of(p.grad), local_of(p)
    return grad.reshape(param.shape) if grad.shape != param.shape and grad.numel() == 0 else grad


def _unsupported(name: str, p: DTensor, why: str) -> ValueError:
    return ValueError(
        f"parameter '{name}' has placements {tuple(p.placements)} on mesh {p.device_mesh}: {why}. "
        "muon_dtensor supports Replicate, Shard(dim) and _StridedShard (FSDP2, HSDP, TP and FSDP x "
        "TP); redistribute the parameter or put it in an AdamW group"
    )


def _shards(p: DTensor, name: str) -> list[AxisShard]:
    shards = []
    for axis, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, StridedShard):
            sf = int(placement.split_factor)
            shards.append(AxisShard(axis, placement.dim, p.device_mesh.size(axis), sf))
        elif type(placement) is Shard:
            shards.append(AxisShard(axis, placement.dim, p.device_mesh.size(axis)))
        else:
            raise _unsupported(name, p, f"placement {placement} on mesh axis {axis} is not supported")
    return shards


def shards_of(p: DTensor, name: str) -> list[AxisShard]:
    """The mesh axes that shard ``p``, in mesh order; ValueError naming ``name`` for placements not
    handled."""
    return _shards(p, name)


def _group_order(mesh: DeviceMesh, axes: tuple[int, ...], ranks: Sequence[int]) -> list[int]:
    """For each group rank (``ranks``: the group's global ranks in group order), the flat
    (row-major over ``axes``) index of its block."""
    return [_axis_ranks(mesh, axes).index(r) for r in ranks]


def _axis_ranks(mesh: DeviceMesh, axes: tuple[int, ...]) -> list[int]:
    """The global ranks that share this rank's coordinates off ``axes``, row-major over ``axes``."""
    coord = mesh.get_coordinate()
    assert coord is not None
    index = [slice(None) if a in axes else coord[a] for a in range(mesh.ndim)]
    return mesh.mesh[tuple(index)].reshape(-1).tolist()


def check_placements(p: Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` if ``p`` is a DTensor whose layout is not handled here, or
    one on a mesh this rank is not part of. Reads metadata only: the same answer on every rank."""
    if not isinstance(p, DTensor):
        return
    if p.device_mesh.get_coordinate() is None:
        raise _unsupported(name, p, f"rank {dist.get_rank()} is not part of its mesh")
    _shards(p, name)


def replica_count(p: Tensor) -> int:
    """How many replicas of ``p`` a mesh holds: the product of its Replicate axes' sizes when some
    axis shards ``p`` (HSDP), else 1 (plain tensors, fully replicated or unsupported placements)."""
    if not isinstance(p, DTensor):
        return 1
    try:
        sharded = {s.axis for s in _shards(p, "")}
    except ValueError:
        return 1  # layout_of raises the error, naming the parameter
    mesh = p.device_mesh
    return math.prod(mesh.size(a) for a in range(mesh.ndim) if a not in sharded) if sharded else 1


def exchange_axes(p: DTensor, name: str, across: bool = False) -> tuple[int, ...]:
    """The mesh axes whose ranks exchange ``p``'s blocks: the sharded ones, or every axis when ``p`` is
    replicated everywhere (then the whole mesh shares its work) or ``across`` its replicas."""
    if across:
        return tuple(range(p.device_mesh.ndim))
    return tuple(s.axis for s in _shards(p, name)) or tuple(range(p.device_mesh.ndim))


def describe(
    p: Tensor, name: str, group: dist.ProcessGroup | None, across: bool = False, planned: bool = False
) -> ParamLayout:
    """The layout of ``p`` given its exchange ``group`` (None: this rank alone); raises ValueError
    naming ``name`` for layouts not handled. A plain tensor with a group is replicated over it (DDP).
    ``across``: the group is the whole mesh and spans ``p``'s replicas. Reads only: the group is
    created by the caller (``optim/group_sharding.layout_of``). ``planned``: no group exists (a
    report on one rank); the layout is that of the group over the exchange axes' ranks, sorted, as
    ``runtime.groups`` creates it, and carries those ranks (``members``) instead of a group."""
    if not isinstance(p, DTensor):
        if group is None or dist.get_world_size(group) == 1:
            return ParamLayout(None, (), (full_block(p.shape),), 0, None)
        size = dist.get_world_size(group)
        return ParamLayout(None, (), (full_block(p.shape),) * size, dist.get_rank(group), group)
    mesh = p.device_mesh
    shards = _shards(p, name)
    across = across and replica_count(p) > 1
    axes = exchange_axes(p, name, across)
    flat = shard_blocks(p.shape, shards) if shards else (full_block(p.shape),) * mesh.size()
    replicas = None
    if across:
        flat, replicas = mesh_blocks(p.shape, tuple(mesh.shape), shards)
    members = tuple(sorted(_axis_ranks(mesh, axes))) if planned else ()
    if group is None and not (planned and len(members) > 1):
        return ParamLayout(mesh, axes, flat, 0, None)
    ranks = members if planned else tuple(dist.get_process_group_ranks(group))
    order = _group_order(mesh, axes, ranks)
    blocks = tuple(flat[i] for i in order)
    replica_of = tuple(replicas[i] for i in order) if replicas is not None else None
    rank = ranks.index(dist.get_rank())
    local_shape, expected = tuple(p.to_local().shape), block_shape(blocks[rank])
    # FSDP2 may give an empty piece the shape (0, 0); only a non-empty one must match exactly.
    if local_shape != expected and (p.to_local().numel() or block_numel(blocks[rank])):
        raise _unsupported(
            name, p, f"its local shape {local_shape} on this rank is not the expected {expected}"
        )
    return ParamLayout(mesh, axes, blocks, rank, group, replica_of, members)


def same_layout(a: Tensor, b: Tensor) -> bool:
    """Whether gradient ``b`` is laid out like parameter ``a`` (same kind, mesh, placements, shape)."""
    if isinstance(a, DTensor) and isinstance(b, DTensor) and dtensor_spec(a) is dtensor_spec(b):
        # FSDP2 builds a parameter's gradients with the parameter's own spec: only the local
        # tensors can differ (the steady step's path, kept short: it runs for every parameter)
        la, lb = local_tensor(a), local_tensor(b)
        return la.shape == lb.shape or la.numel() == lb.numel() == 0
    if not isinstance(a, DTensor):
        return (
            not isinstance(b, DTensor)
            and a.shape == b.shape
            and torch.device(a.device) == torch.device(b.device)
        )
    if not isinstance(b, DTensor):
        return False
    la, lb = local_tensor(a), local_tensor(b)
    same_local = la.shape == lb.shape or la.numel() == lb.numel() == 0
    return (
        same_local
        and a.device_mesh == b.device_mesh
        and tuple(a.placements) == tuple(b.placements)
        and a.shape == b.shape
    )


def row_state_zeros(p: Tensor) -> Tensor:
    """Zeros of shape ``p.shape[:-1] + (1,)`` in ``p``'s dtype (one value per row: NorMuon's second
    moment), laid out with ``p``'s mesh and placements: a ``Shard`` of the last dimension puts the
    single column on that axis's rank 0, exactly where ``p``'s column 0 is."""
    shape = (*p.shape[:-1], 1)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=p.dtype, device=p.device)
    return dtensor_zeros(shape, dtype=p.dtype, device_mesh=p.device_mesh, placements=p.placements)


def block_state_zeros(p: Tensor) -> Tensor:
    """float32 zeros of ``blockwise.absmax_shape(p.shape)`` (int8 momentum's block maxima), laid
    out with ``p``'s mesh and placements: with blocks whole on every shard (``check_params``), each
    rank's maxima are those of its own blocks."""
    shape = absmax_shape(p.shape)
    if not isinstance(p, DTensor):
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    return dtensor_zeros(shape, dtype=torch.float32, device_mesh=p.device_mesh, placements=p.placements)


def relayout(value: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """A state tensor of parameter ``old`` (its shape, or one column of it: ``row_state_zeros``) laid
    out like its replacement ``new``, in ``new``'s dtype if it had ``old``'s, else in its own (a
    ``momentum_dtype`` buffer); a plain full tensor becomes ``new``'s local shard, cut locally.
    Scalars (step counters) stay."""
    shape = tuple(value.shape)
    if value.ndim == 0 or shape not in (tuple(old.shape), (*old.shape[:-1], 1), absmax_shape(old.shape)):
        return value
    full = value.full_tensor() if isinstance(value, DTensor) else value
    full = full.to(device=new.device, dtype=new.dtype if value.dtype == old.dtype else value.dtype)
    if not isinstance(new, DTensor):
        return full
    return distribute_tensor(full, new.device_mesh, new.placements, src_data_rank=None)
