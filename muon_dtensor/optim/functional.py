"""One Muon step on local tensors: the functional core ``Muon.step`` calls.

    momentum     buf <- m buf + (1 - m) g;  X = (1 - m) g + m buf  (Nesterov) or buf, in the NS dtype
    cut          this rank's piece of each matrix of X           (views.View.cut)
    exchange     pieces to each matrix's owner, Newton-Schulz once, results back  (exchange.run_plan)
    place        each result's piece into the parameter's update  (views.View.place)
    update       p <- p (1 - lr wd) - adjusted_lr * O             (elementwise)

NorMuon (``hyper.normuon``) changes only what travels and what the owner computes: a matrix carries
its rows' second moment in leading columns (``normuon.pack``) from the ranks that hold it, the owner
runs ``normuon.normuon_orthogonalize``, and ``finalize`` strips the new second moment into the state.

Every operation is exact per element or a copy, so the layout never changes the arithmetic: a
sharded step equals the one-process step bit for bit (docs/design.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as torch_adamw

from ..base.torch_ops import foreach_add_, foreach_mul, foreach_norm
from ..base.weak_memo import WeakMemo
from ..numerics.blockwise import int8_nesterov_inputs
from ..numerics.elementwise import (
    adamw_update,
    adjust_lr,
    apply_results,
    apply_updates,
    buckets,
    nesterov_inputs,
    scale_results,
)
from ..numerics.newton_schulz import NSConfig, orthogonalize
from ..numerics.normuon import DEFAULT_BETA2, normuon_orthogonalize, pack, unpack
from ..sharding.plan.domains import Domain
from ..sharding.plan.param_layout import local_grad, local_of
from ..sharding.plan.views import View, whole_matrix
from ..sharding.runtime.comm import CommStats
from ..sharding.runtime.exchange import Finalize, run_plan
from ..sharding.runtime.split_exchange import split_compute

__all__ = [
    "Orthogonalize",
    "MuonHyper",
    "adamw_group_step",
    "adamw_step",
    "muon_step",
    "resolve_orthogonalize",
]

# Same-shape full matrices and the group's config -> their results: the one signature every way to
# orthogonalize takes (``newton_schulz.orthogonalize``, Gram through ``config.algorithm``, a
# user's or a test's reference); NorMuon wraps it (``resolve_orthogonalize``).
Orthogonalize = Callable[[Sequence[Tensor], NSConfig], list[Tensor]]


@dataclass(frozen=True)
class MuonHyper:
    lr: float | Tensor  # a Tensor only with ``capturable``: 0-dim float64 on the parameters' device
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | float | None
    normuon: bool = False
    beta2: float = DEFAULT_BETA2
    _scaled: dict[float, Tensor] = field(default_factory=dict, compare=False, repr=False)
    _factors: dict[tuple[int, int], float] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, group: Mapping[str, Any]) -> MuonHyper:
        """A param group's values: a tensor lr read once, as a float, or with ``capturable`` kept
        on its device in float64 (the Python float's arithmetic, so the bits are the float's)."""
        lr = group["lr"]
        device_lr = group.get("capturable", False) and isinstance(lr, Tensor)
        keys = ("weight_decay", "momentum", "nesterov", "adjust_lr_fn")
        hyper = cls(lr.to(torch.float64) if device_lr else float(lr), *(group[k] for k in keys))
        normuon = bool(group.get("normuon", False))
        return replace(hyper, normuon=normuon, beta2=float(group.get("beta2", DEFAULT_BETA2)))

    def factor(self, shape: tuple[int, int]) -> float:
        """``adjust_lr``'s factor for a matrix of global ``shape``, computed once per shape (the
        optimizer keeps a group's ``MuonHyper`` while its settings are unchanged)."""
        factor = self._factors.get(shape)
        if factor is None:
            factor = self._factors[shape] = adjust_lr(1.0, self.adjust_lr_fn, shape)
        return factor

    def adjusted(self, shape: tuple[int, int]) -> float | Tensor:
        """``adjust_lr`` for a matrix of global ``shape``: ``lr * factor``, one device scalar per
        factor with a tensor lr (shapes that share a factor share it)."""
        factor = self.factor(shape)
        if not isinstance(self.lr, Tensor):
            return self.lr * factor
        if factor not in self._scaled:
            self._scaled[factor] = self.lr * factor
        return self._scaled[factor]


def muon_step(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    bufs: Sequence[Tensor],
    domains: Sequence[Domain],
    hyper: MuonHyper,
    config: NSConfig,
    stats: CommStats | None = None,
    *,
    second_moments: Sequence[Tensor] | None = None,
    absmaxes: Sequence[Tensor] | None = None,
    base: Orthogonalize = orthogonalize,
) -> None:
    """Update local tensors ``params`` (with local ``grads`` and momentum ``bufs``) in place; with
    ``hyper.normuon``, also the local NorMuon ``second_moments`` (a column, or none on the ranks that
    do not hold the parameter's column 0), and the domains' views have their ``lead`` columns.
    ``base``: how an owner orthogonalizes a batch of full matrices (``resolve_orthogonalize`` makes
    the group's one compute of it). ``absmaxes``: the block maxima of 8-bit ``bufs``
    (``momentum_dtype="int8"``), None for float buffers."""
    ns_in = _ns_inputs(bufs, grads, absmaxes, hyper, config.dtype)
    compute = _timed(resolve_orthogonalize(hyper, config, base), stats)
    if hyper.normuon:
        assert second_moments is not None, "a NorMuon step needs its second moments"
        ns_in = [_with_second_moment(v, x) for v, x in zip(second_moments, ns_in)]
    assembled = _update_buffers(params, domains)
    for domain in domains:
        pairs = list(domain.members)
        finalize: Finalize = partial(_finalize, pairs, params, assembled, hyper, stats)
        if hyper.normuon:
            assert second_moments is not None
            finalize = partial(_strip_second_moment, pairs, second_moments, finalize)
        run_plan(
            domain.routes,
            prepare=partial(_cut, pairs, ns_in),
            compute=compute,
            finalize=finalize,
            group=domain.group,
            stats=stats,
            split=partial(split_compute, config=config, group=domain.group, stats=stats),
        )
    mine = list(assembled)
    apply_updates(
        [params[i] for i in mine], list(assembled.values()), lr=hyper.lr, weight_decay=hyper.weight_decay
    )


def _ns_inputs(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    absmaxes: Sequence[Tensor] | None,
    hyper: MuonHyper,
    dtype: torch.dtype,
) -> list[Tensor]:
    """The momentum rule on float buffers, or on 8-bit ones with their block maxima; returns the
    Newton-Schulz inputs."""
    if absmaxes is None:
        return nesterov_inputs(bufs, grads, hyper.momentum, hyper.nesterov, dtype)
    return int8_nesterov_inputs(bufs, absmaxes, grads, hyper.momentum, hyper.nesterov, dtype)


def resolve_orthogonalize(
    hyper: MuonHyper, config: NSConfig, base: Orthogonalize = orthogonalize
) -> Callable[[Sequence[Tensor]], list[Tensor]]:
    """A group's one orthogonalizer: ``base`` bound to its config, inside NorMuon's row
    normalization where the group asks for it. Resolved once per group and step."""
    if hyper.normuon:
        return partial(normuon_orthogonalize, config=config, beta2=hyper.beta2, base=base)
    return lambda matrices: base(matrices, config)


def _update_buffers(params: Sequence[Tensor], domains: Sequence[Domain]) -> dict[int, Tensor]:
    """An update tensor per parameter that is not one whole matrix (several matrices, or a split
    matrix's parts), by position; a whole matrix takes its result as soon as its round is back."""
    return {
        pos: torch.empty_like(params[pos], memory_format=torch.contiguous_format)
        for pos in _assembled(params, domains)
    }


# Per plan (by its first domain, held weakly): its domains' ids, the local shapes and the positions
# ``_assembled`` found, so a steady step does not walk every view of every parameter again.
_ASSEMBLED: WeakMemo[tuple[tuple[int, ...], tuple[torch.Size, ...], tuple[int, ...]]] = WeakMemo(256)


def _assembled(params: Sequence[Tensor], domains: Sequence[Domain]) -> tuple[int, ...]:
    """The positions of the parameters that are not one whole matrix (``whole_matrix``)."""
    ids, shapes = tuple(map(id, domains)), tuple(p.shape for p in params)
    kept = _ASSEMBLED.get(domains[0]) if domains else None
    if kept is not None and kept[0] == ids and kept[1] == shapes:
        return kept[2]
    views: dict[int, list[View]] = {pos: [] for pos in range(len(params))}
    for domain in domains:
        for pos, view in domain.members:
            views[pos].append(view)
    positions = tuple(pos for pos, shape in enumerate(shapes) if not whole_matrix(views[pos], shape))
    if domains:
        _ASSEMBLED.put(domains[0], (ids, shapes, positions))
    return positions


def _with_second_moment(v: Tensor, ns_in: Tensor) -> Tensor:
    """The cut source of a NorMuon parameter: its packed second moment in front of its Newton-Schulz
    input on the ranks that hold the column, the input alone elsewhere."""
    return torch.cat([pack(v, ns_in.dtype), ns_in], dim=-1) if v.shape[-1] else ns_in


def _strip_second_moment(
    pairs: Sequence[tuple[int, View]],
    second_moments: Sequence[Tensor],
    finalize: Finalize,
    members: Sequence[int],
    results: Sequence[Tensor],
) -> None:
    """A NorMuon round's pieces: the new second moment (the lead columns of a holder's piece) into
    the state's rows, the rest (``U``) on to the plain finalize."""
    rest = []
    for k, piece in zip(members, results):
        pos, view = pairs[k]
        if second_moments[pos].shape[-1] and piece.shape[-1]:  # a holder's piece, not (0, 0)
            view.place(second_moments[pos], unpack(piece[:, : view.lead]))
            piece = piece[:, view.lead :]
        rest.append(piece)
    finalize(members, rest)


def _cut(pairs: Sequence[tuple[int, View]], ns_in: Sequence[Tensor], k: int) -> Tensor:
    """This rank's piece of matrix ``k`` of a domain, from its parameter's Newton-Schulz input."""
    pos, view = pairs[k]
    return view.cut(ns_in[pos])


def _timed(
    compute: Callable[[Sequence[Tensor]], list[Tensor]], stats: CommStats | None
) -> Callable[[Sequence[Tensor]], list[Tensor]]:
    """``compute``, its host seconds added to ``stats.ns_seconds`` (on CUDA: the time to issue it)."""
    if stats is None:
        return compute

    def timed(matrices: Sequence[Tensor]) -> list[Tensor]:
        start = time.perf_counter()
        out = compute(matrices)
        stats.ns_seconds += time.perf_counter() - start
        return out

    return timed


def _record_update(
    stats: CommStats, results: Sequence[Tensor], factors: Sequence[float], lr: float | Tensor
) -> None:
    """Add this rank's pieces' sum of (lr * factor * result)^2 to ``stats``: a few ops per round,
    on the device, never read here and with no host-to-device copy (both would stop a graph)."""
    pieces = [(r, f) for r, f in zip(results, factors) if r.numel()]
    if not pieces:
        return
    norms = foreach_norm([r for r, _ in pieces], 2, dtype=torch.float32)
    factor = pieces[0][1]
    if all(f == factor for _, f in pieces):  # one multiply, not one per piece: the same bits
        weighted = torch.stack(norms) * factor
    else:
        weighted = torch.stack(foreach_mul(norms, [f for _, f in pieces]))
    total = weighted.square().sum() * (lr * lr)
    stats.update_sq = total if stats.update_sq is None else stats.update_sq + total
    stats.update_elements += sum(r.numel() for r, _ in pieces)


def _finalize(
    pairs: Sequence[tuple[int, View]],
    params: Sequence[Tensor],
    assembled: dict[int, Tensor],
    hyper: MuonHyper,
    stats: CommStats | None,
    members: Sequence[int],
    results: Sequence[Tensor],
) -> None:
    """This rank's pieces of a round's results: whole-matrix parameters updated now, the others
    scaled and placed into their update."""
    shapes = [pairs[k][1].matrix_shape for k in members]
    lrs = [hyper.adjusted(shape) for shape in shapes]
    if stats is not None:
        _record_update(stats, results, [hyper.factor(shape) for shape in shapes], hyper.lr)
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
    them for the bias correction never waits for the device. Parameters that share a count step
    together, in buckets, with multi-tensor ops: a handful of ops per step, not per parameter."""
    if not params:
        return
    foreach_add_(list(steps), 1.0)
    by_count: dict[int, list[int]] = {}
    for i, count in enumerate(torch.stack(list(steps)).tolist()):
        by_count.setdefault(int(count), []).append(i)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    for count, members in by_count.items():
        for _, (p, g, m, v) in buckets([[t[i] for i in members] for t in lists]):
            adamw_update(
                p, g, m, v, step=count, lr=float(lr), betas=betas, eps=eps, weight_decay=weight_decay
            )


def adamw_group_step(
    state: Mapping[Tensor, dict[str, Any]], group: Mapping[str, Any], params: Sequence[Tensor]
) -> None:
    """An AdamW group's step over ``params`` (those with a gradient), on their local shards; with
    ``capturable``, torch's own capturable AdamW (counters and bias correction on the device)."""
    states = [state[p] for p in params]
    if group.get("capturable", False):
        beta1, beta2 = group["betas"]
        torch_adamw(
            [local_of(p) for p in params], [local_grad(p) for p in params],
            [local_of(s["exp_avg"]) for s in states], [local_of(s["exp_avg_sq"]) for s in states],
            [], [s["step"] for s in states], foreach=True, capturable=True, amsgrad=False, beta1=beta1,
            beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
        return
    adamw_step(
        [local_of(p) for p in params],
        [local_grad(p) for p in params],
        [local_of(s["exp_avg"]) for s in states],
        [local_of(s["exp_avg_sq"]) for s in states],
        [s["step"] for s in states],
        **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
    )
