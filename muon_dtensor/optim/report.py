"""What an optimizer holds and plans, for people: ``Muon.memory()`` (state bytes per kind and the
predicted peak of a step's transients) and ``Muon.describe()`` (the coverage table, logged once on
rank 0). Reads the optimizer's state and its groups' plans; the arithmetic is ``sharding.plan.memory``."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.names import param_names, refusal
from ..base.torch_dist import default_group
from ..checks.together import raise_together
from ..features.qk_clip import QKClipFactors
from ..numerics.blockwise import chunk_elements, device_memory
from ..sharding.plan.memory import group_peak
from ..sharding.plan.param_layout import local_of
from ..sharding.plan.views import whole_matrix
from ..sharding.runtime import comm
from ..sharding.runtime.comm import CommStats
from .group_sharding import GroupSharding
from .plan_cache import PlanCache
from .policy import split_policy
from .state import MOMENTUM_ABSMAX, SECOND_MOMENT, momentum_dtype

__all__ = ["KINDS", "METRIC_SCOPES", "Reports", "describe", "log_once", "memory", "metrics", "state_bytes"]

logger = logging.getLogger("muon_dtensor")


class OptimizerView(Protocol):
    """What these reports read of ``optim.optimizer.Muon`` (a protocol: the optimizer imports this module)."""

    param_groups: list[dict[str, Any]]
    state: Any
    comm_stats: CommStats
    _plans: PlanCache

    def _sharding(
        self, index: int, group: dict[str, Any], generation: int | None = None, local: bool = False
    ) -> GroupSharding: ...


class Reports:
    """``Muon.memory``, ``Muon.metrics`` and ``Muon.describe``: local, but ``metrics(reduce=True)``."""

    def memory(self) -> dict[str, int]:  # state bytes per kind, "peak_transient" of a step
        return memory(self)  # type: ignore[arg-type]

    def metrics(
        self, qk_clip: Sequence[QKClipFactors] | None = None, reduce: bool = False, process_group: Any = None
    ) -> dict[str, float]:  # the last step's figures: this rank's, or with reduce=True the job's
        return metrics(self, qk_clip, reduce, process_group)  # type: ignore[arg-type]

    def describe(self) -> str:  # algorithms, elements, matrices, owner balance, what AdamW got, why
        return describe(self)  # type: ignore[arg-type]


# State key -> the kind ``Muon.memory`` reports it under.
KINDS = {
    "momentum_buffer": "momentum",
    MOMENTUM_ABSMAX: "momentum",  # int8 momentum's block maxima: part of its bytes
    SECOND_MOMENT: "normuon_second_moment",
    "exp_avg": "adamw_moments",
    "exp_avg_sq": "adamw_moments",
    "step": "adamw_steps",
}


def state_bytes(
    state: Mapping[Tensor, Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> dict[str, int]:
    """This rank's bytes of every state tensor (its local shard), summed per kind."""
    out = dict.fromkeys(dict.fromkeys(KINDS.values()), 0)
    for group in groups:
        for p in group["params"]:
            for key, value in state.get(p, {}).items():
                if isinstance(value, Tensor):
                    kind = KINDS.get(key, key)
                    out[kind] = out.get(kind, 0) + local_of(value).numel() * value.element_size()
    return out


def memory(opt: OptimizerView) -> dict[str, int]:
    """``state_bytes`` and, under ``"peak_transient"``, the predicted peak of a step's transients
    (every parameter with a gradient): the largest group's, since each group's die with it."""
    peak = 0
    for index, group in enumerate(opt.param_groups):
        locals_ = [local_of(p) for p in group["params"]]
        if group["algorithm"] == "adamw":  # adamw_update: two parameter-sized temporaries at once
            peak = max([peak] + [2 * t.numel() * t.element_size() for t in locals_])
        elif locals_:
            peak = max(peak, _muon_peak(group, opt._sharding(index, group, local=True), locals_))
    return state_bytes(opt.state, opt.param_groups) | {"peak_transient": peak}


def _muon_peak(group: Mapping[str, Any], sharding: GroupSharding, locals_: list[Tensor]) -> int:
    """One Muon group's peak (``sharding.plan.memory.group_peak``) over its plans for every parameter."""
    dtype = group["ns_dtype"]
    momentum = momentum_dtype(group, locals_[0])
    todo = list(range(len(locals_)))
    domains = sharding.domains(todo, group["mode"], group["max_round_bytes"], split_policy(group))
    return group_peak(
        [t.numel() for t in locals_],
        [not whole_matrix(sharding.views[i], t.shape) for i, t in enumerate(locals_)],
        [(d.plan, sharding.layouts[d.members[0][0]].rank, [pos for pos, _ in d.members]) for d in domains],
        param_item=locals_[0].element_size(),
        ns_item=(getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize,
        nesterov=bool(group["nesterov"]),
        cpu=locals_[0].device.type == "cpu",
        normuon=bool(group.get("normuon")),
        gram=group.get("ns_algorithm") == "gram",
        momentum_item=0 if momentum == locals_[0].dtype else momentum.itemsize,
        chunk=chunk_elements(device_memory(locals_[0].device)),
    )


def describe(opt: OptimizerView, build: bool = True) -> str:
    """The coverage table: per group its algorithm, options, parameters, elements, matrices and
    owner balance; then the parameters Muon does not take and why. Local: call it on one rank (the
    usual ``if rank == 0: log(opt.describe())``), before or after the first step; a plan no step
    built yet is built on this rank alone. ``build=False`` reads only the plans a step built."""
    lines = ["| group | algorithm | options | params | elements | matrices | owners (busiest / mean) |"]
    lines.append("|---|---|---|---:|---:|---:|---|")
    totals: Counter[str] = Counter()
    refused, stacks, owners = [], [], []
    for index, group in enumerate(opt.param_groups):
        algo, params = group["algorithm"], group["params"]
        elements = sum(p.numel() for p in params)
        totals[algo] += elements
        matrices, balance = "-", "-"
        if algo == "muon":
            sharding = opt._sharding(index, group, local=True) if build else _built(opt, index)
            matrices, balance = _balance(sharding)
            owners += _owner_lines(sharding, index)
            stacks += _expert_stacks(group, index) if group.get("experts") else []
        else:
            names = param_names(group, index)
            refused += [
                f"  {n} {tuple(p.shape)}: {refusal(n, tuple(p.shape))}" for n, p in zip(names, params)
            ]
        lines.append(
            f"| {index} | {algo} | {_options(group)} | {len(params)} | {elements:,} | {matrices} | {balance} |"
        )
    share = ", ".join(f"{a}: {n:,} elements" for a, n in sorted(totals.items()))
    out = [f"muon_dtensor.Muon: {len(opt.param_groups)} groups; {share}", *lines]
    out += ["expert stacks (experts=True; one matrix per expert):", *stacks] if stacks else []
    out += ["owners of the parameters with replicas (HSDP):", *owners] if owners else []
    return "\n".join(out + (["not in Muon (AdamW) and why:", *refused] if refused else []))


def _expert_stacks(group: Mapping[str, Any], index: int) -> list[str]:
    """Per [E, m, n] parameter of an ``"experts": True`` group: its experts, their shape and how the
    mesh lays it out (``w1 (group 1): 4 experts of 12x8, Shard(0) over ep (2), Shard(1) over fsdp (2); ...``)."""
    lines = []
    for name, p in zip(param_names(group, index), group["params"]):
        if p.dim() == 3:
            lines.append(
                f"  {name} (group {index}): {p.shape[0]} experts of {p.shape[1]}x{p.shape[2]}, {_stack_layout(p)}"
            )
    return lines


def _stack_layout(p: Tensor) -> str:
    """The placements of an expert stack per mesh axis, and whether each expert sits whole on one rank
    (sharded only over the expert dimension: Muon orthogonalizes it there, with no exchange)."""
    if not isinstance(p, DTensor):
        return "whole on this rank (not a DTensor)"
    placements, mesh = p.placements, p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh axis {i}" for i in range(mesh.ndim))
    parts = [
        f"{_placement(pl)} over {n} ({mesh.size(i)})" for i, (pl, n) in enumerate(zip(placements, names))
    ]
    dims = {getattr(pl, "dim", None) for pl in placements if pl.is_shard()}
    if not dims:
        return ", ".join(parts) + "; every rank holds every expert"
    if dims == {0}:
        return ", ".join(parts) + "; each expert whole on one rank (per replica): no exchange"
    return ", ".join(parts) + "; experts cut across ranks: exchanged for Newton-Schulz"


def _placement(pl: Any) -> str:
    """``Shard(d)`` and ``Replicate`` as written in code; others (``_StridedShard``) as torch prints them."""
    if pl.is_shard() and type(pl).__name__ == "Shard":
        return f"Shard({pl.dim})"
    return "Replicate" if pl.is_replicate() else str(pl)


def _built(opt: OptimizerView, index: int) -> GroupSharding | None:
    return opt._plans.built(index)


def _options(group: Mapping[str, Any]) -> str:
    keys = ("head_dim", "experts", "split_sizes", "flatten", "normuon", "ns_split")
    shown = [f"{k}={group[k]}" for k in keys if group.get(k) not in (None, False, "off")]
    return ", ".join(shown) or "-"


def _balance(sharding: GroupSharding | None) -> tuple[str, str]:
    """Matrices, and per exchange group its ranks, busiest rank's Newton-Schulz flops over the mean
    and matrices per rank (fewest to most)."""
    if sharding is None:
        return "-", "not planned yet (before the first step)"
    domains = sharding.domains(list(range(len(sharding.layouts))), "owner", None)
    parts = []
    for d in domains:
        owned = Counter(o for r in d.plan.rounds for o in r.owners)
        counts = [owned.get(r, 0) for r in range(d.plan.group_size)]
        parts.append(
            f"{d.plan.group_size} ranks: {d.plan.imbalance:.3f}, {min(counts)}-{max(counts)} matrices per rank"
        )
    undecided = "" if sharding.decided else " (owners='auto': per replica until the first step decides)"
    return str(sum(len(v) for v in sharding.views)), ("; ".join(parts) or "-") + undecided


def _owner_lines(sharding: GroupSharding | None, index: int) -> list[str]:
    """Per mesh with replicated parameters, the owners chosen and why, once the choice is made."""
    if sharding is None or not sharding.decided:
        return []
    return [f"  group {index}, {choice.describe()}" for choice in sharding.owner_choices]


def log_once(opt: OptimizerView) -> None:
    """``describe`` at INFO on rank 0, after the first step built the layouts (no collective)."""
    if getattr(opt, "_described", False):
        return
    opt._described = True  # type: ignore[attr-defined]
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("%s", describe(opt, build=False))


# Per key of ``metrics()``: "rank" (this rank's share: log it reduced, or know it is one rank's) or
# "job" (the same on every rank). With ``reduce=True`` every key is the job's.
METRIC_SCOPES = {
    "muon/update_rms": "rank", "muon/update_elements": "rank", "muon/bytes_sent": "rank",
    "muon/bytes_received": "rank", "muon/collectives": "rank", "muon/orthogonalized": "rank",
    "muon/ns_seconds": "rank", "muon/matrices": "job", "adamw/tensors": "rank",
    "qk_clip/max_logit": "job", "qk_clip/max_logit_after": "job",
}  # fmt: skip
_SUMMED = (
    "muon/bytes_sent",
    "muon/bytes_received",
    "muon/collectives",
    "muon/orthogonalized",
    "adamw/tensors",
)


def metrics(
    opt: OptimizerView,
    qk_clip: Sequence[QKClipFactors] | None = None,
    reduce: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The last step's figures, flat, for a trainer's logger: the update's RMS over the matrix
    elements this rank holds (adjusted lr times the orthogonalized update; weight decay not
    included), bytes sent and received, collectives, matrices orthogonalized here and their host
    seconds, and the matrices per algorithm; ``METRIC_SCOPES`` says which are this rank's. Reads one
    device scalar (a host sync, here only). With ``qk_clip`` (what ``qk_clip_all_`` returned): the
    largest logit before and after clipping. ``reduce=True``: the job's figures instead, on every
    rank (the update RMS over the whole model, sums of the counts, the slowest rank's seconds),
    collective over ``process_group`` (default: the default group): call it on every rank."""
    stats = opt.comm_stats
    now = (stats.sent, stats.received, stats.collectives, stats.orthogonalized)
    sent, received, collectives, done = (a - b for a, b in zip(now, stats.base))
    squares = float(stats.update_sq) if stats.update_sq is not None else 0.0
    out = {
        "muon/update_elements": float(stats.update_elements),
        "muon/bytes_sent": float(sent),
        "muon/bytes_received": float(received),
        "muon/collectives": float(collectives),
        "muon/orthogonalized": float(done),
        "muon/ns_seconds": stats.ns_seconds,
        "muon/matrices": float(sum(len(v) for e in opt._plans.entries.values() for v in e.sharding.views)),
        "adamw/tensors": float(sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "adamw")),
    }
    if reduce:
        # summed over ranks, each tensor adds 1 / (ranks holding it): counted once, whatever the ranks
        out["adamw/tensors"] = _adamw_share(opt, process_group)
        squares = _reduced(out, squares, process_group)
        out["adamw/tensors"] = float(round(out["adamw/tensors"]))
    elements = out["muon/update_elements"]
    out = {"muon/update_rms": math.sqrt(squares / elements) if elements else 0.0, **out}
    if qk_clip:
        out["qk_clip/max_logit"] = max(float(f.max_logits.max()) for f in qk_clip)
        out["qk_clip/max_logit_after"] = max(float(_clipped(f).max()) for f in qk_clip)
    return out


def _reduced(out: dict[str, float], squares: float, group: dist.ProcessGroup | None) -> float:
    """``out``'s counts summed over ``group`` in place, its seconds the largest; the summed squares.
    After the agreement (``checks/together.py``): a rank that is not calling would be named."""
    if not (dist.is_available() and dist.is_initialized()):
        return squares  # one process: its figures are the job's
    raise_together(None, group, "Muon.metrics(reduce=True)", {"reduce": True})
    summed = [squares, out["muon/update_elements"], *(out[k] for k in _SUMMED)]
    total = comm.sum_over_group(torch.tensor(summed, dtype=torch.float64), _default(group))
    slowest = comm.max_over_group(torch.tensor([out["muon/ns_seconds"]], dtype=torch.float64), group)
    out["muon/update_elements"] = float(total[1])
    out.update({k: float(v) for k, v in zip(_SUMMED, total[2:].tolist())})
    out["muon/ns_seconds"] = float(slowest[0])
    return float(total[0])


def _adamw_share(opt: OptimizerView, group: dist.ProcessGroup | None) -> float:
    """This rank's share of the AdamW tensors: 1 / its mesh's size for a DTensor (each rank of the
    mesh holds a piece of it), 1 / the group's size for a plain tensor (replicated over the group)."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    params = [p for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
    return sum(1.0 / (p.device_mesh.size() if isinstance(p, DTensor) else world) for p in params)


def _default(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else default_group()


def _clipped(factors: QKClipFactors) -> Tensor:
    """Each query head's max logit after clipping: times its factor and its key head's."""
    k = factors.k.repeat_interleave(factors.q.numel() // max(factors.k.numel(), 1))
    return factors.max_logits.float().cpu() * (factors.q * k).float().cpu()
