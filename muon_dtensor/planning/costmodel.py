"""Predict the time of one Muon optimizer step from matrix shapes, the shard-group size and hardware.

Pure arithmetic over the plan (``plan.build_plan`` on ``Shard(0)`` blocks, as FSDP2 lays them out,
with the optimizer's default exchange rounds; for HSDP with owners over the mesh, ``hsdp_plan``):
no process group, no device. ``compare_owners`` prices HSDP's two owner choices for
``Muon(owners="auto")``. Each plan is priced phase by phase in ``phases.py``. A step is three phases, as ``functional.muon_step`` runs them:

1. **pre**: momentum, Nesterov input and the cast to the Newton-Schulz dtype on local shards
   (memory-bound multi-tensor ops), and packing blocks for the all-to-alls;
2. **mid**: the rounds of ``sharding.runtime.exchange.run_plan``, pipelined as it issues them (round
   k+1's all-to-all out and k-1's back travel while round k is orthogonalized; ``links.pipeline_seconds``);
3. **post**: the scaled update and weight decay on local shards (memory-bound).

Each phase costs device time (bytes over memory bandwidth, flops over the matmul rate, link bytes over
link bandwidth plus a latency per collective) and host time (eager ops times a per-op overhead). On an
asynchronous device (CUDA) the host runs ahead: a phase takes the larger of the two, and the host's
post-phase work hides behind the device's mid phase; on a CPU they add up.

A rank's elementwise work is its local share; a round's Newton-Schulz is its busiest rank's share
(owner mode) or all of it (gather mode). Link traffic is counted per rank and per collective from the plan, split into intra-node and inter-node
bytes, and a collective ends when its busiest rank's busiest link is done; its per-rank sum equals
``Plan.bytes_sent`` (``tests/planning/test_costmodel.py`` checks it).

Left out: overlap inside a collective's algorithm, link contention beyond one link each way per GPU,
compute slowed by a concurrent collective, reduced clocks, kernel efficiency by matrix size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from ..numerics.newton_schulz import orthogonalize_flops
from ..sharding.plan.blocks import Block
from ..sharding.plan.build import MatrixEntry, Plan, build_plan
from .hardware import Hardware, fit_latency_bandwidth
from .links import node_pattern
from .memo import once
from .phases import CURRENT, CURRENT_CPU, FUSED, Implementation, ns_config, plan_seconds, step_seconds
from .plans import hsdp_plan, sharded_plan
from .shapes import LLAMA3_8B, LLAMA3_70B, LLAMA31_405B, Shape, transformer_shapes
from .split import split_exchange_seconds

__all__ = [
    "CURRENT",
    "CURRENT_CPU",
    "FUSED",
    "LLAMA31_405B",
    "LLAMA3_70B",
    "LLAMA3_8B",
    "Hardware",
    "Implementation",
    "Prediction",
    "compare_owners",
    "fit_latency_bandwidth",
    "hsdp_plan",
    "predict",
    "sharded_plan",
    "transformer_shapes",
]


@dataclass(frozen=True)
class Prediction:
    """One step, in seconds, on the slowest rank; bytes are per rank per step (sent, both directions)."""

    mode: str
    world_size: int
    total: float
    newton_schulz: float
    comm: float
    memory: float
    host: float
    collectives: int
    bytes_sent_mean: float
    bytes_sent_max: float
    imbalance: float
    replicas: int = 1
    owners: str = "replica"  # where owners were chosen: "mesh" or "replica" (see ``predict``)


def _with_splits(
    plan: Plan,
    p: dict[str, float],
    hw: Hardware,
    nodes: Sequence[int],
    ns_steps: int,
    itemsize: int,
    algorithm: str,
) -> tuple[float, dict[str, float]]:
    """The step with the largest matrices split over a few ranks (``split.py``; ``ns_split="auto"``)."""

    mid, comm, splits = split_exchange_seconds(
        plan, hw, nodes, ns_steps=ns_steps, itemsize=itemsize, ns_algorithm=algorithm
    )
    # "ns" counts the splits' Gram exchanges too; "comm" is the exchange's all-to-alls.
    q = p | {"mid_dev": mid, "ns": splits.makespan, "imbalance": splits.imbalance}
    q["comm"] = p["preflight"] + comm
    # Only where it pays: with no split chosen, or a slower step, the plan stays as it is.
    if splits.split_count and step_seconds(q, hw) < step_seconds(p, hw):
        return step_seconds(q, hw), q
    return step_seconds(p, hw), p


def predict(
    shapes: Sequence[Shape],
    world_size: int,
    hw: Hardware | None = None,
    *,
    mode: str = "owner",
    impl: Implementation = CURRENT,
    ns_steps: int = 5,
    itemsize: int = 2,
    ns_algorithm: str = "standard",
    replicas: int = 1,
    owners: str = "replica",
    split: bool = False,
    check_ranks: int | None = None,
) -> Prediction:
    """Predict one step. ``mode``: "owner", "gather", or "redundant" (Newton-Schulz of every matrix
    on one device and nothing else: the cost every rank pays when each orthogonalizes everything).
    ``ns_algorithm``: the optimizer's, "standard" or "gram" (``newton_schulz.orthogonalize_flops``).
    ``world_size`` ranks shard each matrix; ``replicas`` > 1 is HSDP, mesh rank ``r`` in replica
    ``r // world_size`` (a node holds whole shard groups when they fit). ``owners``: ``"replica"``
    (each replica runs one shard group's step at the same time), ``"mesh"`` (owners among all
    ``replicas * world_size`` ranks) or ``"auto"`` (the faster of the two). ``split``: run the
    largest matrices' Newton-Schulz over a few ranks where that pays (``planning/split.py``; the
    optimizer's ``ns_split="auto"``). ``check_ranks``: the ranks the step's check sums over, where
    they are more than the group's (an expert group's check runs over the experts' whole mesh;
    default ``replicas * world_size``). Computed once per equal arguments (``planning/memo.py``)."""
    hw = hw or Hardware.h200()
    shape_key = cast("tuple[Shape, ...]", tuple(tuple(s) for s in shapes))
    if replicas == 1 and mode != "redundant":
        owners = "replica"  # one replica group: every owner choice is the replica's (one cache entry)
    key = (shape_key, world_size, hw, mode, impl, ns_steps, itemsize, ns_algorithm, replicas, owners, split)
    return once(_predict_cached, _predict, (*key, check_ranks or world_size * replicas))


def _predict(
    shapes: tuple[Shape, ...],
    world_size: int,
    hw: Hardware,
    mode: str,
    impl: Implementation,
    ns_steps: int,
    itemsize: int,
    ns_algorithm: str,
    replicas: int,
    owners: str,
    split: bool,
    checked: int,
) -> Prediction:
    """``predict`` with every argument given (``hw`` too)."""
    if mode == "redundant":
        config = ns_config(ns_steps, itemsize, ns_algorithm)
        ns = sum(orthogonalize_flops(s, config) for s in shapes) / hw.matmul_flops
        return Prediction(mode, world_size, ns, ns, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 1.0, replicas, owners)
    if replicas > 1 and owners == "auto":
        args = (shapes, world_size, hw, mode, impl, ns_steps, itemsize, ns_algorithm, replicas)
        both = [once(_predict_cached, _predict, (*args, o, split, checked)) for o in ("mesh", "replica")]
        return min(both, key=lambda p: p.total)
    across = replicas > 1 and owners == "mesh" and mode == "owner"
    if across:
        plan = hsdp_plan(shapes, world_size, replicas, mode, impl.max_round_bytes)
    else:
        plan = sharded_plan(shapes, world_size, mode, impl.max_round_bytes)
    nodes = [r // hw.gpus_per_node for r in range(plan.group_size)]
    total, p = plan_seconds(plan, hw, impl, ns_steps, itemsize, nodes, ns_algorithm, checked)
    if split and mode == "owner" and plan.group_size > 1:
        total, p = _with_splits(plan, p, hw, nodes, ns_steps, itemsize, ns_algorithm)
    return _prediction(mode, world_size, total, p, plan, replicas, "mesh" if across else "replica")


_predict_cached = lru_cache(maxsize=256)(_predict)  # frozen predictions, safe to share (planning/memo.py)


def _prediction(
    mode: str, world_size: int, total: float, p: dict[str, float], plan: Plan, replicas: int, owners: str
) -> Prediction:
    return Prediction(
        mode=mode,
        world_size=world_size,
        total=total,
        newton_schulz=p["ns"],
        comm=p["comm"],
        memory=p["pre_dev"] - p["preflight"] + p["post_dev"],
        host=p["pre_host"] + p["mid_host"] + p["post_host"],
        collectives=int(p["collectives"]),
        bytes_sent_mean=p["sent_mean"],
        bytes_sent_max=p["sent_max"],
        imbalance=p.get("imbalance", plan.imbalance),
        replicas=replicas,
        owners=owners,
    )


def compare_owners(
    entries: Sequence[MatrixEntry],
    nodes: Sequence[int],
    hw: Hardware | None = None,
    *,
    impl: Implementation = CURRENT,
    ns_steps: int = 5,
    itemsize: int = 2,
) -> dict[str, float]:
    """Seconds of the step for matrices with replicas (entries over the whole mesh, with
    ``replica_of``; group rank r on node ``nodes[r]``), with owners ``"mesh"`` and per ``"replica"``.
    Per replica, matrices laid out alike form one exchange group whose replicas run at once (the
    slowest counts); groups laid out differently run one after the other. Both choices price the
    check over every rank of the mesh, as the step sums it (so ``predict(owners=...)`` of the same
    layout gives the same seconds), and replicas laid out alike on alike nodes are priced once."""
    hw = hw or Hardware.h200()
    if not entries:
        return {"mesh": 0.0, "replica": 0.0}
    n = len(nodes)
    mesh = plan_seconds(build_plan(entries, n, max_round_bytes=impl.max_round_bytes), hw, impl, ns_steps,
                         itemsize, nodes, check_ranks=n)[0]  # fmt: skip
    by_layout: dict[tuple[int, ...] | None, list[MatrixEntry]] = {}
    for e in entries:
        by_layout.setdefault(e.replica_of, []).append(e)
    replica = 0.0
    for replica_of, alike in by_layout.items():
        assert replica_of is not None, "every entry compared has replicas"
        replica += _slowest_replica(alike, replica_of, nodes, hw, impl, ns_steps, itemsize)
    return {"mesh": mesh, "replica": replica}


def _slowest_replica(
    alike: Sequence[MatrixEntry],
    replica_of: tuple[int, ...],
    nodes: Sequence[int],
    hw: Hardware,
    impl: Implementation,
    ns_steps: int,
    itemsize: int,
) -> float:
    """The slowest replica's step for matrices laid out alike, each replica its own exchange group;
    replicas of equal blocks on alike nodes are priced once (blocks shared per content)."""
    n, priced = len(nodes), {}
    shared: dict[tuple[Block, ...], tuple[Block, ...]] = {}
    layouts = {id(e.blocks): e.blocks for e in alike}  # matrices laid out alike share a tuple
    for c in sorted(set(replica_of)):
        ranks = [r for r in range(n) if replica_of[r] == c]
        cut = {k: tuple(b[r] for r in ranks) for k, b in layouts.items()}
        sub_of = {k: shared.setdefault(t, t) for k, t in cut.items()}
        sub = [MatrixEntry(e.shape, sub_of[id(e.blocks)]) for e in alike]
        key = (tuple(id(e.blocks) for e in sub), node_pattern([nodes[r] for r in ranks]))
        if key not in priced:
            plan = build_plan(sub, len(ranks), max_round_bytes=impl.max_round_bytes)
            here = [nodes[r] for r in ranks]
            priced[key] = plan_seconds(plan, hw, impl, ns_steps, itemsize, here, check_ranks=n)[0]
    return max(priced.values())
