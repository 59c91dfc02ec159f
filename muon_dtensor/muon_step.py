"""One Muon step over a param group's parameters: the functional core the Optimizer calls.

Momentum is updated on local tensors; each parameter's matrices (views) are cut from its local
Newton-Schulz input, exchanged and orthogonalized by the plan of their exchange group, placed back
into a local update tensor, and applied. Every step here is exact per element (see update.py), so
the layout never changes the arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from .comm import CommStats
from .exchange import run_plan
from .newton_schulz import NSConfig, orthogonalize
from .placement import ParamLayout
from .plan import MatrixEntry, Plan, build_plan
from .update import adjust_lr, apply_muon_update, muon_momentum, scale_updates
from .views import LocalCut, View

__all__ = ["Domain", "MuonHyper", "build_domains", "muon_step"]


@dataclass(frozen=True)
class MuonHyper:
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None


@dataclass(frozen=True)
class Domain:
    """The matrices of one exchange group: (param position, view index) per plan entry."""

    layout: ParamLayout
    plan: Plan
    members: tuple[tuple[int, int], ...]


def build_domains(
    layouts: Sequence[ParamLayout], views: Sequence[Sequence[View]], mode: str, max_round_bytes: int | None
) -> list[Domain]:
    """Group the views of the given parameters by exchange group and plan each group."""
    grouped: dict[tuple, list[tuple[int, int]]] = {}
    for pos, layout in enumerate(layouts):
        for vi in range(len(views[pos])):
            grouped.setdefault(layout.key, []).append((pos, vi))
    domains = []
    for members in grouped.values():
        layout = layouts[members[0][0]]
        entries = [_entry(views[pos][vi], layout.group_size) for pos, vi in members]
        plan = build_plan(entries, layout.group_size, mode, max_round_bytes=max_round_bytes)
        domains.append(Domain(layout, plan, tuple(members)))
    return domains


def _entry(view: View, group_size: int) -> MatrixEntry:
    whole = ((0, view.shape[0]),), ((0, view.shape[1]),)
    replicated = group_size > 1 and all(b == whole for b in view.blocks)
    return MatrixEntry(view.shape, view.blocks, replicated=replicated)


def cut(local: Tensor, c: LocalCut) -> Tensor:
    """This rank's piece of a view, as a 2-D tensor (a view of ``local`` when contiguous)."""
    t = local[c.expert] if c.expert is not None else local
    if t.ndim == 0 or t.numel() == 0 or c.rows == ((0, 0),):
        return local.new_empty((0, 0))
    t = t.reshape(t.shape[0], -1)
    if len(c.rows) == 1:
        return t[c.rows[0][0] : c.rows[0][1]]
    return torch.cat([t[a:b] for a, b in c.rows])


def place(dest: Tensor, c: LocalCut, value: Tensor) -> None:
    """Write ``value`` (a view's piece) where ``cut`` took it from; ``dest`` is contiguous."""
    if value.numel() == 0:
        return
    t = dest[c.expert] if c.expert is not None else dest
    t = t.view(t.shape[0], -1)
    offset = 0
    for a, b in c.rows:
        t[a:b] = value[offset : offset + b - a]
        offset += b - a


def _whole(local: Tensor, views: Sequence[View]) -> bool:
    """A 2-D parameter that is one matrix: its result is its update, with no assembly."""
    return local.ndim == 2 and len(views) == 1 and views[0].cut == LocalCut(None, ((0, local.shape[0]),))


# Multi-tensor ops allocate their temporaries for a whole list at once (momentum: two fp32 ones).
# Buckets of at most this many local elements bound that transient memory (2 x 256 MiB in fp32)
# while keeping the kernel launches per step few.
BUCKET_ELEMENTS = 1 << 26


def _buckets(tensors: Sequence[Tensor]) -> list[slice]:
    out, start, size = [], 0, 0
    for i, t in enumerate(tensors):
        if size and size + t.numel() > BUCKET_ELEMENTS:
            out.append(slice(start, i))
            start, size = i, 0
        size += t.numel()
    return [*out, slice(start, len(tensors))] if start < len(tensors) else out


def _scale(outs: Sequence[Tensor], dtypes: Sequence[torch.dtype], lrs: Sequence[float]) -> list[Tensor]:
    """``scale_updates`` per parameter dtype (a multi-tensor op takes one dtype), in input order."""
    scaled: dict[int, Tensor] = {}
    for dtype in dict.fromkeys(dtypes):
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        scaled.update(zip(idx, scale_updates([outs[i] for i in idx], dtype, [lrs[i] for i in idx])))
    return [scaled[i] for i in range(len(outs))]


def muon_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    views: Sequence[Sequence[View]],
    domains: Sequence[Domain],
    hyper: MuonHyper,
    config: NSConfig,
    stats: CommStats | None = None,
) -> None:
    """Update local tensors ``params`` (with local ``grads`` and momentum ``bufs``) in place."""
    ns_in: list[Tensor] = []
    for b in _buckets(bufs):
        ns_in += muon_momentum(bufs[b], grads[b], hyper.momentum, hyper.nesterov, config.dtype)
    updates = [
        None if _whole(p, v) else torch.empty_like(p, memory_format=torch.contiguous_format)
        for p, v in zip(params, views)
    ]
    ortho = partial(orthogonalize, config=config)
    for domain in domains:
        pieces = [cut(ns_in[pos], views[pos][vi].cut) for pos, vi in domain.members]
        outs = run_plan(
            domain.plan, domain.layout.rank, pieces, ortho, group=domain.layout.group, stats=stats
        )
        dtypes = [params[pos].dtype for pos, _ in domain.members]
        lrs = [adjust_lr(hyper.lr, hyper.adjust_lr_fn, views[pos][vi].shape) for pos, vi in domain.members]
        for (pos, vi), scaled in zip(domain.members, _scale(outs, dtypes, lrs)):
            if updates[pos] is None:
                updates[pos] = scaled.view(params[pos].shape)  # type: ignore[call-overload]
            else:
                place(updates[pos], views[pos][vi].cut, scaled)
    apply_muon_update(params, updates, lr=hyper.lr, weight_decay=hyper.weight_decay)  # type: ignore[arg-type]
