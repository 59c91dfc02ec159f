"""Every process group muon_dtensor creates is created here, and cached per default process group,
so the groups are dropped with it (``destroy_process_group``) and a new one starts afresh.

Two kinds (docs/design.md, "Process groups"). The exchange groups of a mesh of every rank are
created globally: every rank creates every subgroup, in the same order, while the optimizer builds
its sharding, and torch names them from its world-wide counter. The others (the check's butterfly
pairs, a save's group, the exchange groups of a mesh of some ranks, a pipeline stage's) are created
by their members alone, under a name made of a purpose and the members (``_named``), never from a
rank's own count of groups, which ranks that joined other groups before do not share.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...base.torch_dist import default_group, named_group
from ..plan import grid

__all__ = ["check_groups", "exchange_group", "save_group"]

# default process group -> {key: a group this rank created}; entries go when the default group does
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)
# a scope's group -> (grid.GRID_ABOVE it was made under, its check steps); entries go with the group
_CHECK_STEPS: weakref.WeakKeyDictionary[
    dist.ProcessGroup, tuple[int, list[tuple[dist.ProcessGroup, bool]]]
] = weakref.WeakKeyDictionary()


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
        # enter new_group for it. Only its members create this rank's group, under a name of its
        # members (``_named``), so neither their histories nor the world's counter enter it.
        return _named("exchange", sorted(next(r for r in rows if dist.get_rank() in r)))

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
    its collectives with training's and hang; a group of its own cannot (created on first use by
    the group's ranks, which every save's ranks are)."""
    if not dist.is_initialized():
        return None
    return _named("save", sorted(dist.get_process_group_ranks(group or dist.group.WORLD)), "gloo")


def check_groups(group: dist.ProcessGroup) -> list[tuple[dist.ProcessGroup, bool]]:
    """The steps a small host reduction over ``group`` runs through, in order, each a group and
    whether this rank adds nothing to it (``grid.Step``): ``group`` itself, or above
    ``grid.GRID_ABOVE`` ranks the two-rank groups of a butterfly over its ranks (``grid.py``), so the
    check's sum takes log2 P two-rank all-gathers, not gloo's ring of 4 (P - 1) hops. Each pair is
    created on first use by its two ranks alone, named from its members (``_named``): call this on
    every rank of ``group`` at the same point, as the check's sum is. Kept per group after the first
    call: working the steps out reads the group's P ranks (38 us of CPU at 1,024 ranks, 80 us at
    8,192, every sum of every step before; ``benchmarks/results/check_steps_lookup.json``)."""
    kept = _CHECK_STEPS.get(group)
    if kept is None or kept[0] != grid.GRID_ABOVE:
        size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        pairs = grid.butterfly_steps(size, ranks.index(dist.get_rank()))
        # the ring's case kept empty: a value that held ``group`` would keep its weak key alive
        kept = (grid.GRID_ABOVE, [(_named("check", sorted(ranks[i] for i in p)), z) for p, z in pairs])
        _CHECK_STEPS[group] = kept
    return kept[1] or [(group, False)]


def _named(purpose: str, ranks: list[int], backend: str | None = None) -> dist.ProcessGroup:
    """The group of ``ranks`` (sorted global ranks) for ``purpose``, created by its members alone on
    first use under a name made of the purpose and the members only: the same on every member
    whatever groups each made before, so no member waits at another store prefix (issue 49)."""
    digest = hashlib.sha1("_".join(map(str, ranks)).encode(), usedforsecurity=False).hexdigest()
    name = f"muon_dtensor/{purpose}/{len(ranks)}/{digest}"
    return _cached(("named", purpose, tuple(ranks)), lambda: named_group(ranks, name, backend))
