"""A Muon param group's sharding, derived once: each parameter's layout and matrix views, and per
exchange group (domain) the plan and this rank's routes through it. The step only reads these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..normuon import packed_width
from ..validation import ns_dtype_name
from .comm import sum_over_mesh
from .gangs import Gang
from .owners import across_replicas
from .param_layout import ParamLayout, layout_of, local_of
from .plan import MatrixEntry, Plan, build_plan
from .routes import RoundRoute, build_routes
from .splits import SplitPolicy
from .views import View, holds_first_column, matrix_views, split_view

__all__ = ["Domain", "GroupSharding", "ViewOptions", "build_domains"]

NO_SPLIT = SplitPolicy()


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
        if group.get("normuon", False):
            lead = packed_width(getattr(torch, ns_dtype_name(group.get("ns_dtype", "bfloat16"))))
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


def build_domains(
    layouts: Sequence[ParamLayout],
    views: Sequence[Sequence[View]],
    mode: str,
    max_round_bytes: int | None,
    policy: SplitPolicy = NO_SPLIT,
) -> list[Domain]:
    """Group the views of the given parameters by exchange group; split what ``policy`` says; plan
    and route each group."""
    grouped: dict[tuple, list[tuple[int, View]]] = {}
    for pos, layout in enumerate(layouts):
        for view in views[pos]:
            grouped.setdefault(layout.key, []).append((pos, view))
    domains = []
    for members in grouped.values():
        layout = layouts[members[0][0]]
        ks = policy.ks([view.shape for _, view in members], layout.group_size)
        expanded: list[tuple[int, View]] = []
        gangs = []
        for (pos, view), k in zip(members, ks):
            parts = split_view(view, k, layout.rank) if k > 1 else [view]
            if k > 1:
                gangs.append(Gang(tuple(range(len(expanded), len(expanded) + k)), (), view.shape))
            expanded += [(pos, part) for part in parts]
        entries = [_entry(view, layouts[pos]) for pos, view in expanded]
        plan = build_plan(entries, layout.group_size, mode, max_round_bytes=max_round_bytes, gangs=gangs)
        domains.append(Domain(layout.group, plan, build_routes(plan, layout.rank), tuple(expanded)))
    return domains


class GroupSharding:
    """Layouts and views of a Muon group's parameters, and its domains for each set of parameters
    that has gradients (cached: the routing depends only on the plan and the rank). ``owners``
    (``"auto"``, ``"mesh"``, ``"replica"``) says where HSDP parameters find their owners
    (``owners.across_replicas``; collective for ``"auto"``)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        options: ViewOptions,
        ddp_group: dist.ProcessGroup | None,
        owners: str = "replica",
        second_moments: Sequence[Tensor | None] = (),
    ) -> None:
        self.layouts: list[ParamLayout] = []
        self.views: list[list[View]] = []
        self.across = across_replicas(params, owners, vars(options))
        error: ValueError | None = None
        for i, (p, name) in enumerate(zip(params, names)):
            try:
                across = isinstance(p, DTensor) and p.device_mesh in self.across
                layout = layout_of(p, name, ddp_group, across=across)
                views = matrix_views(p.shape, layout.blocks, layout.rank, name=name, **vars(options))
                if options.lead and views:
                    _check_second_moment(p, second_moments[i], layout, name)
                self.layouts.append(layout)
                self.views.append(views)
            except ValueError as e:
                error = error or e
        _agree_on_error(error, params)
        self._domains: dict[tuple, list[Domain]] = {}

    def domains(
        self, todo: Sequence[int], mode: str, max_round_bytes: int | None, policy: SplitPolicy = NO_SPLIT
    ) -> list[Domain]:
        key = (tuple(todo), mode, max_round_bytes, policy)
        if key not in self._domains:
            layouts = [self.layouts[i] for i in todo]
            views = [self.views[i] for i in todo]
            self._domains[key] = build_domains(layouts, views, mode, max_round_bytes, policy)
        return self._domains[key]


def _check_second_moment(p: Tensor, v: Tensor | None, layout: ParamLayout, name: str) -> None:
    """NorMuon's state must sit where the views put it: the parameter's local rows, one column on
    the ranks that hold the parameter's column 0, none elsewhere (as ``Muon._init_state`` makes it)."""
    holds = holds_first_column(layout.blocks[layout.rank])
    want = (*local_of(p).shape[:-1], 1 if holds else 0)
    got = tuple(local_of(v).shape) if v is not None else None
    if got != want and (got is None or 0 not in got or 0 not in want):  # two empty pieces agree
        raise ValueError(
            f"parameter '{name}': its 'second_momentum_buffer' has local shape {got} on this rank, "
            f"not {want} (a column laid out with the parameter's placements); let the optimizer "
            "create it (remove it from the state) or load it from a checkpoint of this optimizer"
        )


def _agree_on_error(error: ValueError | None, params: Sequence[Tensor]) -> None:
    """The one layout check that can differ between ranks (a local shape) is summed over each mesh,
    so every rank raises together."""
    meshes = {p.device_mesh: None for p in params if isinstance(p, DTensor)}
    failed = sum(int(sum_over_mesh(torch.tensor([int(error is not None)]), m)) for m in meshes)
    if error is not None:
        raise error
    if failed:
        raise ValueError(
            f"building the optimizer failed on {failed} other rank(s) for a parameter of this "
            "group; their error names it (a local shard that does not match its placements)"
        )
