"""Mixture-of-experts models in the cost model: expert stacks ``[E, rows, cols]`` beside the dense
matrices, laid out with or without expert parallelism (``plan --model deepseek-v3 --ep 8``).

Without expert parallelism, each stack is a 3-D parameter FSDP2 shards as any other: ``Shard(0)``
over the shard group's N ranks, which is the expert dimension. Every expert then sits whole on
one rank (``ceil(E / N)`` per rank and stack, none past the E-th rank) and Muon orthogonalizes it
where it is, with no exchange (the plan's "holder", ``sharding/plan/build.py``).

With ``ep`` (torchtitan's layout, ``ParallelDims._build_mesh_with_ep``: data-parallel ranks as
``(dp_shard_mod_ep, dp_shard_in_ep)``, the ep ranks consecutive): the dense matrices are sharded
over all N ranks as before, and each stack is ``Shard(0)`` over the ep axis (E / ep experts per ep
rank) and ``Shard(1)`` (rows) over the F = N / ep ranks of ``dp_shard_mod_ep``, ep ranks apart. With
F = 1 every expert is whole on its rank: no traffic. Otherwise the E / ep experts of an ep rank are
exchanged within its F-rank group, priced as one shard group of F ranks (``costmodel.predict``), all
groups at once; their link speed is that of ranks ep apart (``gpus_per_node / ep`` share a node).
torchtitan itself keeps ``Shard(0)`` on that axis while ``F * ep <= E`` (whole experts again: price
that with ``--ep`` equal to the shard group); the ``Shard(1)`` layout priced here is what it uses
beyond, and what ``tests/sharding/test_moe_layouts.py`` steps.

The optimizer plans such a stack over every rank of the (ep, fsdp) mesh (its exchange group is every
axis that shards it) and owns each expert on one of its F ranks (``MatrixEntry.sharers``), so it
moves the bytes priced here (``tests/planning/test_planning_moe.py`` holds a small case to them).

Dense and expert groups are exchanged one after the other (separate parameter groups), so the step
and its parts add up, as ``costmodel.compare_owners`` adds groups laid out differently.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, replace

from .costmodel import CURRENT, Hardware, Implementation, Prediction, predict
from .plans import rank_memory, sharded_plan
from .shapes import DEEPSEEK_V3, KIMI_K2, MoEModel

__all__ = [
    "MOE_MODELS",
    "ExpertLayout",
    "MoEPrediction",
    "check_ep",
    "expert_owned",
    "moe_memory",
    "moe_predict",
]

MOE_MODELS: dict[str, MoEModel] = {"deepseek-v3": DEEPSEEK_V3, "kimi-k2": KIMI_K2}


@dataclass(frozen=True)
class ExpertLayout:
    """``shard`` data-parallel ranks; ``ep`` expert-parallel ranks (None: no expert parallelism)."""

    shard: int
    ep: int | None = None

    @property
    def fsdp(self) -> int:
        """Ranks that shard one expert: N / ep with expert parallelism, else 1 (experts whole)."""
        return self.shard // self.ep if self.ep else 1

    def experts_per_group(self, experts: int) -> int:
        """Experts of each stack one expert group holds (an ep rank's F ranks, or one rank)."""
        return experts // self.ep if self.ep else math.ceil(experts / self.shard)


@dataclass(frozen=True)
class MoEPrediction:
    """The step (``step``) and its two exchange groups run one after the other."""

    dense: Prediction
    experts: Prediction
    step: Prediction


def _divisors(*values: int) -> list[int]:
    g = math.gcd(*values)
    return [d for d in range(1, g + 1) if g % d == 0]


def check_ep(model: MoEModel | None, name: str, ep: int | None, shard: int, replicate: int) -> None:
    """ValueError naming ``--ep``, its value and the fix, for a layout the cost model cannot price."""
    if ep is None:
        return
    if model is None:
        raise ValueError(
            f"--ep {ep}: {name} has no expert stacks; --ep goes with an MoE preset "
            f"(--model {' or '.join(MOE_MODELS)})"
        )
    if replicate > 1:
        raise ValueError(
            f"--ep {ep} with --replicate {replicate}: expert parallelism is priced within one shard "
            f"group; plan one replica group (--gpus {shard} --ep {ep}), whose step every replica runs"
        )
    hint = ", ".join(map(str, _divisors(shard, model.experts)[-4:]))
    if shard % ep:
        raise ValueError(
            f"--ep {ep} does not divide --gpus {shard}: the ep groups tile the data-parallel ranks "
            f"(gpus / ep ranks shard each expert); give an --ep that divides both {shard} and the "
            f"{model.experts} experts, e.g. {hint}"
        )
    if model.experts % ep:
        raise ValueError(
            f"--ep {ep} does not divide {name}'s {model.experts} experts: each ep rank holds experts / ep "
            f"whole experts of every stack; give an --ep that divides both, e.g. {hint}"
        )


def _expert_hw(hw: Hardware, layout: ExpertLayout) -> Hardware:
    """``hw`` as an expert group sees it: its ranks are ep apart, so gpus_per_node / ep share a node."""
    if not layout.ep:
        return hw
    return replace(hw, gpus_per_node=max(1, hw.gpus_per_node // layout.ep))


def _all_experts(model: MoEModel, hw: Hardware, ns_steps: int, ns_algorithm: str) -> Prediction:
    """Newton-Schulz of every expert of the model on one device (``mode="redundant"``)."""
    one = predict(list(model.stacks), 1, hw, mode="redundant", ns_steps=ns_steps, ns_algorithm=ns_algorithm)
    k = model.experts * model.moe_layers
    return replace(one, total=one.total * k, newton_schulz=one.newton_schulz * k)


def moe_predict(
    model: MoEModel,
    layout: ExpertLayout,
    hw: Hardware | None = None,
    *,
    mode: str = "owner",
    impl: Implementation = CURRENT,
    ns_steps: int = 5,
    ns_algorithm: str = "standard",
    split: bool = False,
) -> MoEPrediction:
    """The step for ``model`` on ``layout``: dense matrices ``Shard(0)`` over ``layout.shard`` ranks,
    then the expert groups (module docstring); ``mode="redundant"``: every matrix on one device."""
    hw = hw or Hardware.h200()
    dense = predict(
        list(model.dense), layout.shard, hw, mode=mode, impl=impl, ns_steps=ns_steps,
        ns_algorithm=ns_algorithm, split=split,
    )  # fmt: skip
    if mode == "redundant":
        experts = _all_experts(model, hw, ns_steps, ns_algorithm)
    else:
        # with ep the optimizer plans a stack over the experts' whole mesh: its check sums over it,
        # and a round's bytes are shared by the ep groups, which exchange their matrices in it at once
        limit = (
            impl.max_round_bytes // layout.ep if impl.max_round_bytes and layout.ep else impl.max_round_bytes
        )
        experts = predict(
            model.expert_shapes(layout.experts_per_group(model.experts)), layout.fsdp,
            _expert_hw(hw, layout), mode=mode, impl=replace(impl, max_round_bytes=limit), ns_steps=ns_steps,
            ns_algorithm=ns_algorithm,
            split=split, check_ranks=layout.shard if layout.ep else None,
        )  # fmt: skip
    # Mean Newton-Schulz per rank: every expert once over the N ranks (gather: the groups' copies too).
    per_rank = _all_experts(model, hw, ns_steps, ns_algorithm).newton_schulz / layout.shard
    if mode == "gather":
        per_rank *= layout.fsdp
    elif mode == "redundant":
        per_rank = experts.newton_schulz
    mean = dense.newton_schulz / dense.imbalance + per_rank
    return MoEPrediction(dense, experts, _sum(dense, experts, layout.shard, mean))


def _sum(dense: Prediction, experts: Prediction, world: int, mean_ns: float) -> Prediction:
    """The two groups' step, one after the other: seconds, collectives and bytes add (every rank is
    in one expert group, so the mean adds; the max is the sum of the maxima, an upper bound)."""
    ns = dense.newton_schulz + experts.newton_schulz
    return replace(
        dense,
        world_size=world,
        total=dense.total + experts.total,
        newton_schulz=ns,
        comm=dense.comm + experts.comm,
        memory=dense.memory + experts.memory,
        host=dense.host + experts.host,
        collectives=dense.collectives + experts.collectives,
        bytes_sent_mean=dense.bytes_sent_mean + experts.bytes_sent_mean,
        bytes_sent_max=dense.bytes_sent_max + experts.bytes_sent_max,
        imbalance=ns / mean_ns if mean_ns else 1.0,
    )


def _held(model: MoEModel, layout: ExpertLayout, rank: int) -> int:
    """Experts of each stack ``rank`` holds: whole ones, FSDP2's chunks of the expert dimension
    without ep; with ep, every rank of a group holds rows of its group's E / ep."""
    per = layout.experts_per_group(model.experts)
    if layout.ep:
        return per
    return max(0, min(per, model.experts - rank * per))


def expert_owned(model: MoEModel, layout: ExpertLayout, limit: int | None) -> list[int]:
    """Expert matrices each of the N ranks orthogonalizes in a step (owner mode); their sum is
    ``model.expert_matrices``, each expert once in the world."""
    stacks = len(model.stacks) * model.moe_layers
    if not layout.ep or layout.fsdp == 1:
        return [_held(model, layout, r) * stacks for r in range(layout.shard)]
    shapes = model.expert_shapes(layout.experts_per_group(model.experts))
    plan = sharded_plan(shapes, layout.fsdp, "owner", limit)
    owned = Counter(o for rnd in plan.rounds for o in rnd.owners)
    # global rank f * ep + c is group rank f of ep rank c (ep inner, as torchtitan lays it out)
    return [owned.get(r // layout.ep, 0) for r in range(layout.shard)]


def moe_memory(
    model: MoEModel, layout: ExpertLayout, limit: int | None, momentum_dtype: str = "float32"
) -> dict[str, list[int]]:
    """Per rank of the N, ``Muon.memory``'s figures: the momentum of the dense and expert blocks it
    holds, and the larger of the two groups' peak transients (each group's die with it)."""
    dense_m, dense_p = rank_memory(tuple(model.dense), layout.shard, 1, False, limit, momentum_dtype)
    groups: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {0: ((0,), (0,))}
    momentum, peak = [], []
    for r in range(layout.shard):
        held = _held(model, layout, r)
        if held not in groups:  # one plan per group: the ep group's F ranks, or one rank's experts
            shapes = tuple(model.expert_shapes(held))
            groups[held] = rank_memory(shapes, layout.fsdp, 1, False, limit, momentum_dtype)
        exp_m, exp_p = groups[held]
        group_rank = r // layout.ep if layout.ep else 0  # group rank r // ep of ep rank r % ep
        momentum.append(dense_m[r] + exp_m[group_rank])
        peak.append(max(dense_p[r], exp_p[group_rank]))
    return {"momentum": momentum, "peak_transient": peak}


def _where(model: MoEModel, layout: ExpertLayout) -> str:
    per = layout.experts_per_group(model.experts)
    if not layout.ep:
        return (
            f"no --ep: each stack Shard(0) over the {layout.shard} ranks (FSDP2's dim 0), up to {per} whole "
            "experts per rank and stack, orthogonalized where they sit (no exchange)"
        )
    where = (
        "whole on their rank (no exchange)"
        if layout.fsdp == 1
        else f"rows Shard(1) over the {layout.fsdp} ranks of dp_shard_mod_ep (exchanged within them)"
    )
    return f"ep {layout.ep} x fsdp-in-ep {layout.fsdp}: Shard(0) over ep, {per} experts per ep rank, {where}"


def report_lines(model: MoEModel, layout: ExpertLayout, parts: MoEPrediction, owned: list[int]) -> list[str]:
    """The report's expert lines: the layout, and each exchange group's step, bytes and balance."""
    d, e = parts.dense, parts.experts
    return [
        f"experts: {model.experts} routed x {len(model.stacks)} stacks x {model.moe_layers} MoE layers = "
        f"{model.expert_matrices:,} matrices; {_where(model, layout)}",
        f"  dense matrices (Shard(0) over {layout.shard} ranks): {d.total * 1e3:.1f} ms, sent per rank "
        f"{d.bytes_sent_mean / 1e6:,.1f} MB mean, {d.bytes_sent_max / 1e6:,.1f} MB max",
        f"  experts (groups of {layout.fsdp} rank(s)): {e.total * 1e3:.1f} ms, sent per rank "
        f"{e.bytes_sent_mean / 1e6:,.1f} MB mean, {e.bytes_sent_max / 1e6:,.1f} MB max; each expert once "
        f"in the world ({sum(owned):,}), {min(owned):,}-{max(owned):,} per rank",
    ]


def moe_json(
    model: MoEModel, layout: ExpertLayout, parts: MoEPrediction, owned: list[int]
) -> dict[str, object]:
    """``--json``'s ``"experts"``: the layout, both groups' predictions and the owners' expert counts."""
    return {
        "model": model.name,
        "ep": layout.ep,
        "fsdp_in_ep": layout.fsdp if layout.ep else None,
        "expert_matrices": model.expert_matrices,
        "dense": asdict(parts.dense),
        "experts": asdict(parts.experts),
        "owned_per_rank": {"min": min(owned), "max": max(owned), "sum": sum(owned)},
    }
