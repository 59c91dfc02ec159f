"""Read a parameter's layout (plain tensor or DTensor) into the layout module's plain data: once per
parameter at set-up into its record (``LayoutRecord``: mesh, placements, global and local shapes, the
axes that shard it, its replica count, its blocks), which the owner policy, the owner pricing
(``owners.py``) and the layouts given an exchange group (``describe``: ``ParamLayout``) read instead
of asking the DTensor again. Reads metadata only: no collective."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros

from ...base.compat import StridedShard, local_tensor
from ...base.torch_dist import dtensor_spec
from ...base.weak_memo import WeakMemo
from ...numerics.blockwise import absmax_shape
from .blocks import AxisShard, Block, block_numel, block_shape, full_block, mesh_blocks, shard_blocks

__all__ = [
    "LayoutRecord",
    "check_placements",
    "ParamLayout",
    "describe",
    "relayout",
    "row_state_zeros",
    "block_state_zeros",
    "local_grad",
    "local_of",
    "read_layout",
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
    # plain fields, not properties: the plans read them for every parameter without a call back here
    group_size: int = field(init=False, compare=False)
    key: tuple = field(init=False, compare=False)  # equal keys share an exchange group (and a plan)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_size", len(self.blocks))
        object.__setattr__(self, "key", (self.group, len(self.blocks), self.members))


@dataclass(frozen=True)
class LayoutRecord:
    """What the set-up reads of one parameter, once (``read_layout``). ``mesh`` is None for a plain
    tensor; ``shards`` are the mesh axes that shard it, in mesh order; ``replicas`` is the product of
    the Replicate axes' sizes when some axis shards it (HSDP), else 1; ``axes`` are the mesh axes
    whose ranks exchange its blocks (the sharded ones, or every axis when it is replicated
    everywhere); ``blocks`` is each of their ranks' block, row-major over ``axes``."""

    mesh: DeviceMesh | None
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    local_numel: int
    shards: tuple[AxisShard, ...]
    replicas: int
    axes: tuple[int, ...]
    blocks: tuple[Block, ...]


def read_layout(p: Tensor, name: str) -> LayoutRecord:
    """``p``'s record; ValueError naming ``name`` for a placement not handled, or for a mesh this
    rank is not part of. Blocks tuples are shared by the parameters of one layout (``blocks.py``)."""
    shape = tuple(int(s) for s in p.shape)
    if not isinstance(p, DTensor):
        return LayoutRecord(None, (), (), shape, shape, math.prod(shape), (), 1, (), (full_block(shape),))
    mesh = p.device_mesh
    if mesh.get_coordinate() is None:
        raise _unsupported(name, p, f"rank {dist.get_rank()} is not part of its mesh")
    shards = tuple(_shards(p, name))
    mesh_shape = tuple(int(s) for s in mesh.shape)
    sharded = [s.axis for s in shards]
    replicas = math.prod(s for a, s in enumerate(mesh_shape) if a not in sharded) if shards else 1
    axes = tuple(sharded) or tuple(range(len(mesh_shape)))
    blocks = shard_blocks(shape, shards) if shards else (full_block(shape),) * math.prod(mesh_shape)
    local = tuple(int(s) for s in local_tensor(p).shape)
    placements = tuple(p.placements)
    return LayoutRecord(
        mesh, mesh_shape, placements, shape, local, math.prod(local), shards, replicas, axes, blocks
    )


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, the tensor itself otherwise (shares memory either way)."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def local_grad(p: Tensor) -> Tensor:
    """The local gradient of ``p``, shaped like the local parameter (an empty FSDP2 piece may be
    (0, 0) on one and (n, 0) on the other)."""
    assert p.grad is not None, "the preflight steps only parameters with a gradient"
    grad, param = local_of(p.grad), local_of(p)
    return grad.reshape(param.shape) if grad.shape != param.shape and grad.numel() == 0 else grad


def _unsupported(name: str, p: DTensor | LayoutRecord, why: str) -> ValueError:
    placements, mesh = (
        (p.placements, p.mesh) if isinstance(p, LayoutRecord) else (p.placements, p.device_mesh)
    )
    return ValueError(
        f"parameter '{name}' has placements {tuple(placements)} on mesh {mesh}: {why}. "
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


@dataclass
class _MeshMemo:
    """What a layout reads from one mesh, kept per mesh while the mesh lives (``_MEMOS``): its axis
    ranks per exchange axes, read from ``DeviceMesh.mesh`` once (torch 2.13 rebuilds that tensor from
    the mesh's layout on every access), each exchange group's block order, and the ordered blocks
    per blocks tuple. A set-up then does O(world) work per mesh and layout, and O(1) per parameter.
    It holds no mesh and no group: the memo of a dropped mesh goes with it."""

    coordinate: tuple[int, ...]
    ranks: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    # per group (None: planned without one), per (axes, planned): ranks, order, this rank's index
    orders: WeakMemo[dict[tuple, tuple[tuple[int, ...], tuple[int, ...], int]]] = field(
        default_factory=WeakMemo
    )
    # per flat blocks tuple, per order tuple: the blocks and replicas in group order
    ordered: WeakMemo[WeakMemo[tuple[tuple[Block, ...], tuple[int, ...] | None]]] = field(
        default_factory=WeakMemo
    )


_MEMOS: WeakMemo[_MeshMemo] = WeakMemo()  # per mesh, held weakly
MESH_READS = [0]  # ``DeviceMesh.mesh`` reads by layouts, for tests that bound the set-up's work


def _memo(mesh: DeviceMesh) -> _MeshMemo:
    coordinate = tuple(mesh.get_coordinate() or ())
    memo = _MEMOS.get(mesh)
    if memo is None or memo.coordinate != coordinate:
        memo = _MEMOS.put(mesh, _MeshMemo(coordinate))
    return memo


def _axis_ranks(mesh: DeviceMesh, axes: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks that share this rank's coordinates off ``axes``, row-major over ``axes``."""
    memo = _memo(mesh)
    ranks = memo.ranks.get(axes)
    if ranks is None:
        coord = mesh.get_coordinate()
        assert coord is not None
        index = [slice(None) if a in axes else coord[a] for a in range(mesh.ndim)]
        MESH_READS[0] += 1
        ranks = memo.ranks[axes] = tuple(mesh.mesh[tuple(index)].reshape(-1).tolist())
    return ranks


def _group_order(
    mesh: DeviceMesh, axes: tuple[int, ...], group: dist.ProcessGroup | None, planned: bool
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """The exchange group's global ranks in group order (``planned``: the axis ranks, sorted, as
    ``runtime.groups`` creates the group), for each group rank the flat (row-major over ``axes``)
    index of its block, and this rank's group rank; once per (mesh, axes, group)."""
    orders = _memo(mesh).orders
    per_group = orders.get(group)
    if per_group is None:
        per_group = orders.put(group, {})
    hit = per_group.get((axes, planned))
    if hit is not None:
        return hit
    axis_ranks = _axis_ranks(mesh, axes)
    ranks = tuple(sorted(axis_ranks)) if planned else tuple(dist.get_process_group_ranks(group))
    where = {r: i for i, r in enumerate(axis_ranks)}
    order = tuple(where[r] for r in ranks)
    if order == tuple(range(len(order))):
        order = _IDENTITY
    hit = per_group[(axes, planned)] = (ranks, order, ranks.index(dist.get_rank()))
    return hit


_IDENTITY: tuple[int, ...] = ()  # the order that keeps every block where it is


def _ordered(
    mesh: DeviceMesh, flat: tuple[Block, ...], replicas: tuple[int, ...] | None, order: tuple[int, ...]
) -> tuple[tuple[Block, ...], tuple[int, ...] | None]:
    """``flat`` and ``replicas`` in group order; the same tuples for every parameter of a layout (so
    the plan's per-entry tables share them by identity), and ``flat`` itself where the group's
    order is the mesh's."""
    if order is _IDENTITY:
        return flat, replicas
    ordered = _memo(mesh).ordered
    per_flat = ordered.get(flat)
    if per_flat is None:
        per_flat = ordered.put(flat, WeakMemo())
    hit = per_flat.get(order)
    if hit is not None:
        return hit
    blocks = tuple(flat[i] for i in order)
    replica_of = tuple(replicas[i] for i in order) if replicas is not None else None
    return per_flat.put(order, (blocks, replica_of))


def check_placements(p: Tensor, name: str) -> None:
    """Raise ValueError naming ``name`` if ``p`` is a DTensor whose layout is not handled here, or
    one on a mesh this rank is not part of. Reads metadata only: the same answer on every rank."""
    if not isinstance(p, DTensor):
        return
    if p.device_mesh.get_coordinate() is None:
        raise _unsupported(name, p, f"rank {dist.get_rank()} is not part of its mesh")
    _shards(p, name)


def describe(
    p: Tensor | LayoutRecord,
    name: str,
    group: dist.ProcessGroup | None,
    across: bool = False,
    planned: bool = False,
) -> ParamLayout:
    """The layout of ``p`` (its record, or the tensor, read here) given its exchange ``group`` (None:
    this rank alone); raises ValueError naming ``name`` for layouts not handled. A plain tensor with
    a group is replicated over it (DDP). ``across``: the group is the whole mesh and spans the
    replicas. Reads only: the group is created by the caller (``optim/group_sharding.layout_of``).
    ``planned``: no group exists (a report on one rank); the layout is that of the group over the
    exchange axes' ranks, sorted, as ``runtime.groups`` creates it, and carries those ranks
    (``members``) instead of a group."""
    record = p if isinstance(p, LayoutRecord) else read_layout(p, name)
    mesh = record.mesh
    if mesh is None:
        whole = full_block(record.shape)
        if group is None or dist.get_world_size(group) == 1:
            return ParamLayout(None, (), (whole,), 0, None)
        return ParamLayout(None, (), (whole,) * dist.get_world_size(group), dist.get_rank(group), group)
    across = across and record.replicas > 1
    axes = tuple(range(len(record.mesh_shape))) if across else record.axes
    flat, replicas = (
        mesh_blocks(record.shape, record.mesh_shape, record.shards) if across else (record.blocks, None)
    )
    if group is None and not (planned and len(_axis_ranks(mesh, axes)) > 1):
        return ParamLayout(mesh, axes, flat, 0, None)
    ranks, order, rank = _group_order(mesh, axes, group, planned)
    blocks, replica_of = _ordered(mesh, flat, replicas, order)
    expected = block_shape(blocks[rank])
    # FSDP2 may give an empty piece the shape (0, 0); only a non-empty one must match exactly.
    if record.local_shape != expected and (record.local_numel or block_numel(blocks[rank])):
        why = f"its local shape {record.local_shape} on this rank is not the expected {expected}"
        raise _unsupported(name, record, why)
    return ParamLayout(mesh, axes, blocks, rank, group, replica_of, ranks if planned else ())


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
