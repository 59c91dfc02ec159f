"""One Muon step over a param group's parameters: the functional core the Optimizer calls.

Momentum is updated on local tensors; each parameter's matrices (views) are cut from its local
Newton-Schulz input, exchanged and orthogonalized by the plan of their exchange group, placed back
into a local update tensor, and applied. Every step here is exact per element (see update.py), so
the layout never changes the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from ._sharding.comm import CommStats
from ._sharding.exchange import run_plan
from .newton_schulz import NSConfig, orthogonalize
from ._sharding.param_layout import ParamLayout
from ._sharding.plan import MatrixEntry, Plan, build_plan
from .elementwise import adjust_lr, apply_muon_update, muon_momentum, scale_updates
from ._sharding.views import LocalCut, View

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


# Elementwise work runs as multi-tensor ops over buckets of at most this many local elements. On
# CUDA a bucket is big: few launches, and the ops' temporaries (momentum: two fp32 ones) stay below
# 2 x 256 MiB. On CPU the ops run one tensor at a time anyway, and cache-sized pieces keep a piece in
# cache across its five passes (512 KiB in fp32; 64Ki-256Ki measured 25% faster than whole tensors on
# the 2-core VM, docs/benchmarks.md). Every op is exact per element, so pieces change no bit.
BUCKET_ELEMENTS = 1 << 26
CPU_PIECE_ELEMENTS = 1 << 17


def elementwise_buckets(groups: Sequence[Sequence[Tensor]]) -> Iterator[tuple[list[int], list[list[Tensor]]]]:
    """Aligned pieces of ``groups`` (``groups[k][i]`` alike in shape for every k), in buckets; yields
    (index of each piece's tensor, pieces per group). On CPU, contiguous tensors are cut into flat
    ranges of ``CPU_PIECE_ELEMENTS``, each its own bucket."""
    if not groups or not groups[0]:
        return
    cpu = groups[0][0].device.type == "cpu"
    limit = CPU_PIECE_ELEMENTS if cpu else BUCKET_ELEMENTS
    index: list[int] = []
    bucket: list[list[Tensor]] = [[] for _ in groups]
    size = 0
    for i in range(len(groups[0])):
        whole = [g[i] for g in groups]
        n = whole[0].numel()
        parts = [whole]
        if cpu and n > limit and all(t.is_contiguous() for t in whole):
            parts = [[t.view(-1)[a : a + limit] for t in whole] for a in range(0, n, limit)]
        for part in parts:
            if size and size + part[0].numel() > limit:
                yield index, bucket
                index, bucket, size = [], [[] for _ in groups], 0
            index.append(i)
            for k, t in enumerate(part):
                bucket[k].append(t)
            size += part[0].numel()
    if index:
        yield index, bucket


def _momentum(
    bufs: Sequence[Tensor], grads: Sequence[Tensor], hyper: MuonHyper, dtype: torch.dtype
) -> list[Tensor]:
    ns_in = [torch.empty_like(b, dtype=dtype, memory_format=torch.contiguous_format) for b in bufs]
    for _, (b, g, out) in elementwise_buckets([bufs, grads, ns_in]):
        muon_momentum(b, g, out, hyper.momentum, hyper.nesterov)
    return ns_in


def _scale(outs: Sequence[Tensor], dtypes: Sequence[torch.dtype], lrs: Sequence[float]) -> list[Tensor]:
    """Each result times its adjusted lr, in its parameter's dtype: fresh contiguous tensors."""
    scaled = [torch.empty(o.shape, dtype=d, device=o.device) for o, d in zip(outs, dtypes)]
    for index, (src, dst) in elementwise_buckets([outs, scaled]):
        scale_updates(src, dst, [lrs[i] for i in index])
    return scaled


def _apply_whole(
    params: Sequence[Tensor], outs: Sequence[Tensor], lrs: Sequence[float], hyper: MuonHyper
) -> None:
    """``param <- param (1 - lr wd) - adjusted_lr * out`` where one result is a parameter's whole update.

    Bucket by bucket, so on CPU the scaled update lives in one cache-sized piece at a time instead of
    a fresh parameter-sized tensor (fresh memory costs page faults: 13 ms against 1.8 ms for 6M
    elements on the 2-core VM)."""
    outs = [o.reshape(p.shape) for o, p in zip(outs, params)]
    for index, (p, o) in elementwise_buckets([list(params), outs]):
        scaled = [torch.empty(t.shape, dtype=t_p.dtype, device=t.device) for t, t_p in zip(o, p)]
        scale_updates(o, scaled, [lrs[i] for i in index])
        apply_muon_update(p, scaled, lr=hyper.lr, weight_decay=hyper.weight_decay)


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
    ns_in = _momentum(bufs, grads, hyper, config.dtype)
    # A parameter whose update is one result is updated as soon as its round is back; the others
    # (several matrices per parameter) assemble an update tensor first.
    whole = [_whole(p, v) for p, v in zip(params, views)]
    updates = {
        pos: torch.empty_like(params[pos], memory_format=torch.contiguous_format)
        for pos in range(len(params))
        if not whole[pos]
    }
    ortho = partial(orthogonalize, config=config)
    for domain in domains:
        pieces = [cut(ns_in[pos], views[pos][vi].cut) for pos, vi in domain.members]
        outs = run_plan(
            domain.plan, domain.layout.rank, pieces, ortho, group=domain.layout.group, stats=stats
        )
        lrs = [adjust_lr(hyper.lr, hyper.adjust_lr_fn, views[pos][vi].shape) for pos, vi in domain.members]
        now = [k for k, (pos, _) in enumerate(domain.members) if whole[pos]]
        later = [k for k, (pos, _) in enumerate(domain.members) if not whole[pos]]
        _apply_whole(
            [params[domain.members[k][0]] for k in now], [outs[k] for k in now], [lrs[k] for k in now], hyper
        )
        dtypes = [params[domain.members[k][0]].dtype for k in later]
        for k, scaled in zip(later, _scale([outs[k] for k in later], dtypes, [lrs[k] for k in later])):
            pos, vi = domain.members[k]
            place(updates[pos], views[pos][vi].cut, scaled)
    for _, (p, u) in elementwise_buckets([[params[pos] for pos in updates], list(updates.values())]):
        apply_muon_update(p, u, lr=hyper.lr, weight_decay=hyper.weight_decay)
