"""What an optimizer holds and plans, for people: ``Muon.memory()`` (state bytes per kind and the
predicted peak of a step's transients) and ``Muon.describe()`` (the coverage table, logged once on
rank 0). Reads the optimizer's state and its groups' plans; the arithmetic is ``_sharding.memory``."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ._sharding.memory import group_peak
from ._sharding.param_layout import local_of
from ._sharding.views import whole_matrix
from .param_groups import refusal
from .policy import split_policy
from .preflight import param_names
from .sharding import GroupSharding
from .state import SECOND_MOMENT

__all__ = ["KINDS", "describe", "log_once", "memory", "state_bytes"]

logger = logging.getLogger("muon_dtensor")


class Muon(Protocol):
    """What these reports read of ``optimizer.Muon`` (a protocol: the optimizer imports this module)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _shardings: dict[int, tuple[tuple, GroupSharding]]

    def _sharding(self, index: int, group: dict[str, Any]) -> GroupSharding: ...


# State key -> the kind ``Muon.memory`` reports it under.
KINDS = {
    "momentum_buffer": "momentum",
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


def memory(opt: Muon) -> dict[str, int]:
    """``state_bytes`` and, under ``"peak_transient"``, the predicted peak of a step's transients
    (every parameter with a gradient): the largest group's, since each group's die with it."""
    peak = 0
    for index, group in enumerate(opt.param_groups):
        locals_ = [local_of(p) for p in group["params"]]
        if group["algorithm"] == "adamw":  # adamw_update: two parameter-sized temporaries at once
            peak = max([peak] + [2 * t.numel() * t.element_size() for t in locals_])
        elif locals_:
            peak = max(peak, _muon_peak(group, opt._sharding(index, group), locals_))
    return state_bytes(opt.state, opt.param_groups) | {"peak_transient": peak}


def _muon_peak(group: Mapping[str, Any], sharding: GroupSharding, locals_: list[Tensor]) -> int:
    """One Muon group's peak (``_sharding.memory.group_peak``) over its plans for every parameter."""
    dtype = group["ns_dtype"]
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
    )


def describe(opt: Muon, build: bool = True) -> str:
    """The coverage table: per group its algorithm, options, parameters, elements, matrices and
    owner balance; then the parameters Muon does not take and why. ``build=False`` reads only the
    layouts already built (no collective)."""
    lines = ["| group | algorithm | options | params | elements | matrices | owners (busiest / mean) |"]
    lines.append("|---|---|---|---:|---:|---:|---|")
    totals: Counter[str] = Counter()
    refused = []
    for index, group in enumerate(opt.param_groups):
        algo, params = group["algorithm"], group["params"]
        elements = sum(p.numel() for p in params)
        totals[algo] += elements
        matrices, balance = "-", "-"
        if algo == "muon":
            sharding = opt._sharding(index, group) if build else _built(opt, index)
            matrices, balance = _balance(sharding)
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
    return "\n".join(out + (["not in Muon (AdamW) and why:", *refused] if refused else []))


def _built(opt: Muon, index: int) -> GroupSharding | None:
    entry = opt._shardings.get(index)
    return entry[1] if entry is not None else None


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
    return str(sum(len(v) for v in sharding.views)), "; ".join(parts) or "-"


def log_once(opt: Muon) -> None:
    """``describe`` at INFO on rank 0, after the first step built the layouts (no collective)."""
    if getattr(opt, "_described", False):
        return
    opt._described = True  # type: ignore[attr-defined]
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("%s", describe(opt, build=False))
