"""A Muon group's exchange groups (domains) as plain data: which views share an exchange group, and
per domain the plan and this rank's routes through it. Pure: the caller (``sharding.GroupSharding``)
made the layouts and groups and decided the splits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...numerics.normuon import packed_width
from .build import MatrixEntry, Plan, build_plan
from .gangs import Gang
from .param_layout import ParamLayout
from .routes import RoundRoute, build_routes
from .views import View, split_view

__all__ = ["Domain", "ViewOptions", "build_domain", "group_members"]


@dataclass(frozen=True)
class ViewOptions:
    """How a group's parameters split into matrices (see ``views.matrix_views``)."""

    flatten: bool = False
    experts: bool = False
    split_sizes: tuple[int, ...] | None = None
    head_dim: int | None = None
    lead: int = 0  # NorMuon: columns of the Newton-Schulz dtype that carry the second moment

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> ViewOptions:
        split = group.get("split_sizes")
        flags = group.get("flatten", False), group.get("experts", False)
        lead = 0
        if group.get("normuon", False):  # the name validation stores, or a dtype set later
            dtype = group.get("ns_dtype", "bfloat16")
            lead = packed_width(dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype))
        return cls(*flags, tuple(split) if split else None, group.get("head_dim"), lead)


@dataclass(frozen=True)
class Domain:
    """The matrices of one exchange group: (param position, view) per plan entry (a split matrix's
    parts are views of their own), the plan, and this rank's route through each of its rounds."""

    group: dist.ProcessGroup | None
    plan: Plan
    routes: tuple[RoundRoute, ...]
    members: tuple[tuple[int, View], ...]


def _entry(view: View, layout: ParamLayout) -> MatrixEntry:
    whole = ((0, view.shape[0]),), ((0, view.shape[1]),)
    replicated = layout.group_size > 1 and all(b == whole for b in view.blocks)
    return MatrixEntry(view.shape, view.blocks, replicated=replicated, replica_of=layout.replica_of)


def group_members(
    layouts: Sequence[ParamLayout], views: Sequence[Sequence[View]]
) -> list[list[tuple[int, View]]]:
    """The (param position, view) pairs of each exchange group, in parameter order."""
    grouped: dict[tuple, list[tuple[int, View]]] = {}
    for pos, layout in enumerate(layouts):
        for view in views[pos]:
            grouped.setdefault(layout.key, []).append((pos, view))
    return list(grouped.values())


def build_domain(
    members: Sequence[tuple[int, View]],
    layouts: Sequence[ParamLayout],
    ks: Sequence[int],
    mode: str,
    max_round_bytes: int | None,
) -> Domain:
    """One exchange group's domain: each member split into ``ks[i]`` part views (1: whole), planned
    and routed for this rank."""
    layout = layouts[members[0][0]]
    expanded: list[tuple[int, View]] = []
    gangs = []
    for (pos, view), k in zip(members, ks):
        parts = split_view(view, k, layout.rank) if k > 1 else [view]
        if k > 1:
            gangs.append(Gang(tuple(range(len(expanded), len(expanded) + k)), (), view.shape))
        expanded += [(pos, part) for part in parts]
    entries = [_entry(view, layouts[pos]) for pos, view in expanded]
    plan = build_plan(entries, layout.group_size, mode, max_round_bytes=max_round_bytes, gangs=gangs)
    return Domain(layout.group, plan, build_routes(plan, layout.rank), tuple(expanded))
