"""A Muon param group's sharding, set up where the step starts: each parameter's layout and
exchange group (``layout_of`` creates the groups, collectively), its matrix views, the owner meshes
and splits that ``policy`` decides, and the domains built from them (``sharding.plan.domains``, pure).
The step only reads these."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..checks.together import raise_together
from ..sharding.plan.domains import Domain, ViewOptions, build_domain, group_members
from ..sharding.plan.param_layout import LayoutRecord, ParamLayout, describe, local_of, read_layout
from ..sharding.plan.views import View, holds_first_column, matrix_views
from ..sharding.runtime.groups import exchange_group
from .policy import SplitPolicy, owner_meshes

__all__ = ["GroupSharding", "layout_of"]

NO_SPLIT = SplitPolicy()


def layout_of(
    p: Tensor | LayoutRecord,
    name: str,
    ddp_group: dist.ProcessGroup | None = None,
    *,
    across: bool = False,
    planned: bool = False,
) -> ParamLayout:
    """The layout of ``p`` (its record, or the tensor, read here), creating its exchange group on
    first use (collective: every rank calls this for the same parameters in the same order).
    ``ddp_group`` serves plain tensors. ``across``: owners over the whole mesh, so a parameter with
    replicas (HSDP) exchanges over all its ranks. ``planned``: no group is created (a report on one
    rank: ``param_layout.describe``)."""
    record = p if isinstance(p, LayoutRecord) else read_layout(p, name)
    if record.mesh is None:
        return describe(record, name, ddp_group)
    across = across and record.replicas > 1
    axes = tuple(range(len(record.mesh_shape))) if across else record.axes
    many = math.prod(record.mesh_shape[a] for a in axes) > 1
    group = exchange_group(record.mesh, axes) if many and not planned else None
    return describe(record, name, group, across, planned)


class GroupSharding:
    """Layouts and views of a Muon group's parameters, and its domains for each set of parameters
    that has gradients (built per step's parameter set; ``optim/plan_cache.py`` keeps them). ``owners``
    (``"auto"``, ``"mesh"``, ``"replica"``) says where HSDP parameters find their owners
    (``policy.owner_meshes``; collective for ``"auto"``). ``local``: built on this rank alone for a
    report (no group created, no vote: ``"auto"`` is taken as ``"replica"`` and ``decided`` is False,
    for the first step decides it; an error raises on this rank only)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        options: ViewOptions,
        ddp_group: dist.ProcessGroup | None,
        owners: str = "replica",
        second_moments: Sequence[Tensor | None] = (),
        local: bool = False,
    ) -> None:
        self.layouts: list[ParamLayout] = []
        self.views: list[list[View]] = []
        # each parameter's layout facts, read once here (None where they are refused, in ``errors``)
        self.records, errors = _read_records(params, names)
        read = [r for r in self.records if r is not None]
        self.decided = not (local and owners == "auto" and any(r.replicas > 1 for r in read))
        # where HSDP parameters take their owners, and why (``describe`` prints ``owner_choices``)
        self.across, self.owner_choices = owner_meshes(
            read, "replica" if local and owners == "auto" else owners, vars(options)
        )
        error: ValueError | None = None
        for i, (record, name) in enumerate(zip(self.records, names)):
            try:
                if record is None:
                    raise errors[i]
                across = record.mesh is not None and record.mesh in self.across
                layout = layout_of(record, name, ddp_group, across=across, planned=local)
                views = matrix_views(record.shape, layout.blocks, layout.rank, name=name, **vars(options))
                if options.lead and views:
                    _check_second_moment(record, second_moments[i], layout, name)
                self.layouts.append(layout)
                self.views.append(views)
            except ValueError as e:
                error = error or e
        if local and error is not None:
            raise error
        if not local:
            _agree_on_error(error, params)

    def domains(
        self, todo: Sequence[int], mode: str, max_round_bytes: int | None, policy: SplitPolicy = NO_SPLIT
    ) -> list[Domain]:
        """The domains of the parameters at ``todo`` (``optim/plan_cache.py`` keeps them)."""
        layouts = [self.layouts[i] for i in todo]
        views = [self.views[i] for i in todo]
        return [
            build_domain(members, layouts, ks, mode, max_round_bytes)
            for members in group_members(layouts, views)
            for ks in [policy.ks([v.shape for _, v in members], layouts[members[0][0]].group_size)]
        ]


def _read_records(
    params: Sequence[Tensor], names: Sequence[str]
) -> tuple[list[LayoutRecord | None], dict[int, ValueError]]:
    """Each parameter's record, and by position the errors of those whose layout is refused."""
    records: list[LayoutRecord | None] = []
    errors: dict[int, ValueError] = {}
    for i, (p, name) in enumerate(zip(params, names)):
        try:
            records.append(read_layout(p, name))
        except ValueError as e:
            records.append(None)
            errors[i] = e
    return records, errors


def _check_second_moment(record: LayoutRecord, v: Tensor | None, layout: ParamLayout, name: str) -> None:
    """NorMuon's state must sit where the views put it: the parameter's local rows, one column on
    the ranks that hold the parameter's column 0, none elsewhere (as ``state.init_state`` makes it)."""
    holds = holds_first_column(layout.blocks[layout.rank])
    want = (*record.local_shape[:-1], 1 if holds else 0)
    got = tuple(local_of(v).shape) if v is not None else None
    if got != want and (got is None or 0 not in got or 0 not in want):  # two empty pieces agree
        raise ValueError(
            f"parameter '{name}': its 'second_momentum_buffer' has local shape {got} on this rank, "
            f"not {want} (a column laid out with the parameter's placements); let the optimizer "
            "create it (remove it from the state) or load it from a checkpoint of this optimizer"
        )


def _agree_on_error(error: ValueError | None, params: Sequence[Tensor]) -> None:
    """The one layout check that can differ between ranks (a local shape) is raised together over
    each mesh in order; a failure learned on one mesh travels on to the next, so a rank that shares
    only a later mesh with the failing one raises too."""
    first: BaseException | None = error
    for mesh in {p.device_mesh: None for p in params if isinstance(p, DTensor)}:
        try:
            raise_together(first, mesh, "building the optimizer's layouts")
        except Exception as e:  # noqa: BLE001 - raised below, after every mesh has heard of it
            first = first or e
    if first is not None:
        raise first
