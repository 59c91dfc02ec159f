"""One Muon step on local tensors: the functional core ``Muon.step`` calls.

    momentum     buf <- m buf + (1 - m) g;  X = (1 - m) g + m buf  (Nesterov) or buf, in the NS dtype
    cut          this rank's piece of each matrix of X           (views.View.cut)
    exchange     pieces to each matrix's owner, Newton-Schulz once, results back  (exchange.run_plan)
    place        each result's piece into the parameter's update  (views.View.place)
    update       p <- p (1 - lr wd) - adjusted_lr * O             (elementwise)

Every operation is exact per element or a copy, so the layout never changes the arithmetic: a
sharded step equals the one-process step bit for bit (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ._sharding.comm import CommStats
from ._sharding.domains import Domain
from ._sharding.exchange import run_plan
from ._sharding.views import View, whole_matrix
from .elementwise import (
    adamw_update,
    adjust_lr,
    apply_results,
    apply_updates,
    nesterov_inputs,
    scale_results,
)
from .newton_schulz import NSConfig, orthogonalize

__all__ = ["MuonHyper", "adamw_step", "muon_step"]


@dataclass(frozen=True)
class MuonHyper:
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | float | None

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> MuonHyper:
        """A param group's values (a tensor lr read once, as a float)."""
        keys = ("weight_decay", "momentum", "nesterov", "adjust_lr_fn")
        return cls(float(group["lr"]), *(group[k] for k in keys))


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
    ns_in = nesterov_inputs(bufs, grads, hyper.momentum, hyper.nesterov, config.dtype)
    # A parameter that is one matrix takes its result as its update as soon as its round is back;
    # the others (several matrices per parameter) assemble an update tensor first.
    assembled = {
        pos: torch.empty_like(p, memory_format=torch.contiguous_format)
        for pos, p in enumerate(params)
        if not whole_matrix(views[pos], p.shape)
    }
    for domain in domains:
        pairs = [(pos, views[pos][vi]) for pos, vi in domain.members]
        run_plan(
            domain.routes,
            prepare=partial(_cut, pairs, ns_in),
            compute=partial(orthogonalize, config=config),
            finalize=partial(_finalize, pairs, params, assembled, hyper),
            group=domain.group,
            stats=stats,
        )
    mine = list(assembled)
    apply_updates(
        [params[i] for i in mine], list(assembled.values()), lr=hyper.lr, weight_decay=hyper.weight_decay
    )


def _cut(pairs: Sequence[tuple[int, View]], ns_in: Sequence[Tensor], k: int) -> Tensor:
    """This rank's piece of matrix ``k`` of a domain, from its parameter's Newton-Schulz input."""
    pos, view = pairs[k]
    return view.cut(ns_in[pos])


def _finalize(
    pairs: Sequence[tuple[int, View]],
    params: Sequence[Tensor],
    assembled: dict[int, Tensor],
    hyper: MuonHyper,
    members: Sequence[int],
    results: Sequence[Tensor],
) -> None:
    """This rank's pieces of a round's results: whole-matrix parameters updated now, the others
    scaled and placed into their update."""
    lrs = [adjust_lr(hyper.lr, hyper.adjust_lr_fn, pairs[k][1].shape) for k in members]
    now = [i for i, k in enumerate(members) if pairs[k][0] not in assembled]
    later = [i for i, k in enumerate(members) if pairs[k][0] in assembled]
    apply_results(
        [params[pairs[members[i]][0]] for i in now],
        [results[i] for i in now],
        [lrs[i] for i in now],
        lr=hyper.lr,
        weight_decay=hyper.weight_decay,
    )
    dtypes = [params[pairs[members[i]][0]].dtype for i in later]
    scaled = scale_results([results[i] for i in later], dtypes, [lrs[i] for i in later])
    for i, value in zip(later, scaled):
        pos, view = pairs[members[i]]
        view.place(assembled[pos], value)


def adamw_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """torch.optim.AdamW on local tensors, in place; each ``steps`` counter is incremented first.

    The counters are CPU tensors (as torch.optim.AdamW keeps them unless ``capturable``), so reading
    one for the bias correction never waits for the device."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        adamw_update(
            p, g, m, v, step=int(step), lr=float(lr), betas=betas, eps=eps, weight_decay=weight_decay
        )
