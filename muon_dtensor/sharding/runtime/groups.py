"""Every process group muon_dtensor creates is created here, and cached per default process group,
so the groups are dropped with it (``destroy_process_group``) and a new one starts afresh.

Creating a group is collective over the default group: each function is called on every rank for
the same arguments in the same order (while the optimizer builds its sharding, or on a first save).
The exception: the exchange groups of a mesh of fewer ranks than the world (a pipeline stage's) are
created by that mesh's ranks alone.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...base.torch_dist import default_group
from ..plan import grid

__all__ = ["check_groups", "exchange_group", "save_group"]

# default process group -> {key: a group this rank created}; entries go when the default group does
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)


def _cached(key: tuple, create: Callable[[], dist.ProcessGroup]) -> dist.ProcessGroup:
    groups = _GROUPS.setdefault(default_group(), {})
    if key not in groups:
        groups[key] = create()
    return groups[key]


def exchange_group(mesh: DeviceMesh, axes: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of this rank over mesh ``axes`` (the others fixed).

    One axis is the mesh's own group. Several axes (FSDP x TP) need new groups; ``new_group`` is
    collective over the default group, so every rank creates every subgroup of the mesh, in the
    same order: call this on all ranks for the same (mesh, axes), e.g. while building the optimizer.
    On a mesh of fewer ranks than the world, call it on that mesh's ranks (they alone create it).
    """
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    if len(axes) == mesh.ndim and mesh.size() == dist.get_world_size():
        # the whole mesh is every rank (HSDP owners over the mesh): the default group serves
        return default_group()

    others = [a for a in range(mesh.ndim) if a not in axes]
    rows = mesh.mesh.permute(*others, *axes).reshape(-1, math.prod(mesh.size(a) for a in axes)).tolist()
    if mesh.size() < dist.get_world_size():
        # A mesh of some ranks (a pipeline stage's): the other ranks build other optimizers and never
        # enter new_group for it. Only its members create this rank's group, named by its ranks, so
        # the counter that names every rank's later groups stays the same on all ranks.
        mine = sorted(next(r for r in rows if dist.get_rank() in r))
        return _cached(("local", tuple(mine)), lambda: dist.new_group(mine, use_local_synchronization=True))

    def create() -> dist.ProcessGroup:
        mine = None
        for ranks in rows:
            group = dist.new_group(sorted(ranks))
            mine = group if dist.get_rank() in ranks else mine
        assert mine is not None, "this rank is in its own mesh"
        return mine

    return _cached(("exchange", tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape), axes), create)


def save_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A gloo group used only by saves: an async save that shares the training group can interleave
    its collectives with training's and hang; a group of its own cannot (collective on first use)."""
    if not dist.is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    return _cached(("save", ranks), lambda: dist.new_group(list(ranks), backend="gloo"))


def check_groups(group: dist.ProcessGroup) -> list[dist.ProcessGroup]:
    """The groups a small host reduction over ``group`` runs through, in order: ``group`` itself, or
    above ``grid.GRID_ABOVE`` ranks one subgroup per axis of a grid over its ranks (``grid.py``), so
    the check's sum takes 4 sum(side - 1) hops of gloo's ring, not 4 (P - 1). The subgroups are
    created on first use by their members alone (each rank its own, axis by axis): call this on
    every rank of ``group`` at the same point, as the check's sum is."""
    size = dist.get_world_size(group)
    factors = grid.grid_factors(size)
    if not factors:
        return [group]
    ranks = tuple(dist.get_process_group_ranks(group))

    def create() -> list[dist.ProcessGroup]:
        me = ranks.index(dist.get_rank())
        members = [sorted(ranks[i] for i in grid.grid_axis(factors, me, a)) for a in range(len(factors))]
        return [dist.new_group(m, use_local_synchronization=True) for m in members]

    groups = _GRIDS.setdefault(default_group(), {})
    hit = groups.get(id(group))
    if hit is None or hit[0] is not group:
        hit = groups[id(group)] = (group, create())
    return hit[1]


# default process group -> {id of a group: (the group, its grid's subgroups)}
_GRIDS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, tuple[dist.ProcessGroup, list]]] = (
    weakref.WeakKeyDictionary()
)
