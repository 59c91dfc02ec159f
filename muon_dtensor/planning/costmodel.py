"""Predict the time of one Muon optimizer step from matrix shapes, the shard-group size and hardware.

Pure arithmetic over the plan (``plan.build_plan`` on ``Shard(0)`` blocks, as FSDP2 lays them out,
with the optimizer's default exchange rounds; for HSDP with owners over the mesh, ``hsdp_plan``):
no process group, no device. ``compare_owners`` prices HSDP's two owner choices for
``Muon(owners="auto")``. A step is three phases, as ``functional.muon_step`` runs them:

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

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import cast

import torch

from ..numerics.newton_schulz import DEFAULT_COEFFICIENTS, NSConfig, orthogonalize_flops
from ..sharding.plan.blocks import Block
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, Round, build_plan
from .hardware import Hardware, check_collectives, check_seconds, fit_latency_bandwidth
from .host_ops import StepShape, step_ops
from .links import back_links, local_elements, node_pattern, pipeline_seconds, to_owner_links
from .memo import once
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
class Implementation:
    """What the step's code does per element, per matrix and per bucket, apart from the machine.

    The defaults count the code as built (``elementwise.py``, ``functional.py``,
    ``sharding/runtime/exchange.py``), in bytes read plus written per local element (fp32) and in eager
    ops. Momentum: ``grad * (1 - m)`` 8, ``buf *= m`` 8, ``buf += `` 12; Nesterov ``buf * m`` 8,
    ``+=`` 12; copy to bf16 6: 54 bytes.
    Update: copy to fp32 6, ``*= lr`` 8, ``param *= 1 - lr wd`` 8, ``-=`` 12: 34 bytes. Every bf16
    element packed for an all-to-all or assembled into a full matrix is read and written: 4 bytes.
    Host: the ops ``host_ops.step_ops`` counts from the busiest rank's routes; per bucket of
    ``bucket_elements``, ``pre_bucket_ops`` multi-tensor calls for the momentum and
    ``post_bucket_ops`` for the update.
    """

    pre_bytes: float = 54.0
    post_bytes: float = 34.0
    copy_bytes: float = 4.0
    pre_bucket_ops: int = 6
    post_bucket_ops: int = 4
    bucket_elements: int = 1 << 26  # elementwise.BUCKET_ELEMENTS
    batched_ns: bool = True  # one Newton-Schulz call per shape per round (CUDA) or per matrix (CPU)
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES  # None: one round, no overlap


CURRENT = Implementation()
# On CPU: Newton-Schulz one matrix at a time (oneDNN's batched bf16 GEMM was slower) and elementwise
# work in cache-sized pieces (elementwise.CPU_PIECE_ELEMENTS).
CURRENT_CPU = Implementation(batched_ns=False, bucket_elements=1 << 17)
# Not built: one fused kernel for momentum (read g, buf; write buf, bf16 input: 4+4+4+2) and one for
# the update (read param, bf16 result; write param: 4+2+4) per bucket.
FUSED = replace(CURRENT, pre_bytes=14.0, post_bytes=10.0, pre_bucket_ops=1, post_bucket_ops=1)


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


def _replicas(entry: MatrixEntry) -> int:
    return _replica_count(entry.replica_of) if entry.replica_of is not None else 1


@lru_cache(maxsize=64)  # a mesh's layouts share one replica_of tuple
def _replica_count(replica_of: tuple[int, ...]) -> int:
    return len(set(replica_of))


def _round_comm(
    plan: Plan, rnd: Round, hw: Hardware, itemsize: int, nodes: Sequence[int]
) -> tuple[float, float, list[float]]:
    """Seconds of a round's all-to-all to the owners and back (0 in gather mode), and bytes sent per rank."""
    n = plan.group_size
    if n == 1:
        return 0.0, 0.0, [0.0]
    to_owners = to_owner_links(plan, rnd.members, rnd.owners, itemsize, nodes)
    if plan.mode != "owner":
        return to_owners.seconds(hw), 0.0, [to_owners.sent(r) for r in range(n)]
    back = back_links(plan, rnd.members, rnd.owners, itemsize, nodes)
    return to_owners.seconds(hw), back.seconds(hw), [to_owners.sent(r) + back.sent(r) for r in range(n)]


def _ns_config(ns_steps: int, itemsize: int, algorithm: str) -> NSConfig:
    """The Newton-Schulz the model counts: torch's default coefficients, in the dtype of ``itemsize``
    (the Gram form's restarts depend on both)."""
    dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    return NSConfig((DEFAULT_COEFFICIENTS,) * ns_steps, dtype=dtype, algorithm=algorithm)


def _round_compute(plan: Plan, rnd: Round, hw: Hardware, impl: Implementation, config: NSConfig) -> float:
    """The busiest rank's device seconds in a round: assemble its matrices, orthogonalize, pack results
    (for every replica's ranks, with owners over the mesh)."""
    n, worst = plan.group_size, 0.0
    for r in range(n):
        mine = rnd.owned_by(r)
        flops = sum(orthogonalize_flops(plan.entries[m].shape, config) for m in mine)
        copies = 0.0
        for m in mine if n > 1 else ():  # assemble (+ pack back, once per replica)
            packs = 1 if plan.mode == "gather" else 1 + _replicas(plan.entries[m])
            copies += packs * math.prod(plan.entries[m].shape)
        worst = max(worst, flops / hw.matmul_flops + copies * impl.copy_bytes / hw.memory_bandwidth)
    return worst


def _host_ops(plan: Plan, impl: Implementation, ns_steps: int, local: int) -> tuple[float, float, float]:
    """Eager ops before, during and after the exchange, on the rank that owns the most Newton-Schulz
    work, counted from its routes as the code issues them (``host_ops.step_ops``, held to the
    profiler's count by tests/planning/test_host_model.py); the step's checks count with the first phase."""
    busiest = max(range(plan.group_size), key=lambda r: plan.loads[r])
    buckets = math.ceil(local / impl.bucket_elements)
    shape = StepShape(
        muon_params=len(plan.entries),
        muon_buckets=buckets,
        bucket_elements=impl.bucket_elements,
        batched=impl.batched_ns,
        ns_steps=ns_steps,
        momentum_ops=impl.pre_bucket_ops,
        update_ops=impl.post_bucket_ops,
    )
    parts = step_ops(plan, busiest, shape)
    return parts["checks"] + parts["pre"], parts["exchange"], parts["post"]


def _busiest_ns_flops(plan: Plan, config: NSConfig) -> int:
    """Newton-Schulz flops of the busiest rank in a step: ``max(plan.loads) * ns_steps`` for the
    standard iteration; the plan balances those, so a Gram step may be less even."""
    per_rank = [0] * plan.group_size
    for rnd in plan.rounds:
        for r in range(plan.group_size):
            shapes = [plan.entries[m].shape for m in rnd.owned_by(r)]
            per_rank[r] += sum(orthogonalize_flops(s, config) for s in shapes)
    return max(per_rank)


def _phases(
    plan: Plan,
    hw: Hardware,
    impl: Implementation,
    ns_steps: int,
    itemsize: int,
    nodes: Sequence[int],
    algorithm: str = "standard",
    check_ranks: int = 0,
) -> dict[str, float]:
    """Device and host seconds of the pre, mid and post phases, and the exchange's parts; the check
    sums over ``check_ranks`` (the step's ranks; 0: the plan's group)."""
    n = plan.group_size
    comm = [_round_comm(plan, rnd, hw, itemsize, nodes) for rnd in plan.rounds]
    config = _ns_config(ns_steps, itemsize, algorithm)
    compute = [_round_compute(plan, rnd, hw, impl, config) for rnd in plan.rounds]
    sent = [sum(c[2][r] for c in comm) for r in range(n)]
    preflight = check_seconds(hw, check_ranks or n) if n > 1 else 0.0
    checks = check_collectives(hw, check_ranks or n)
    local = max(local_elements(plan), default=0)
    # blocks packed for the all-to-all to the owners: for the other ranks of this rank's replica
    replicas = max((_replicas(e) for e in plan.entries), default=1)
    shards = n // replicas
    pack = local * (shards - 1) / shards * (shards if plan.mode == "gather" else 1 / replicas)
    pre, mid, post = _host_ops(plan, impl, ns_steps, local)
    return {
        "ns": _busiest_ns_flops(plan, config) / hw.matmul_flops,
        "comm": preflight + sum(c[0] + c[1] for c in comm),
        "collectives": (2 if plan.mode == "owner" else 1) * len(plan.rounds) + checks if n > 1 else 0,
        "sent_mean": sum(sent) / n,
        "sent_max": max(sent),
        "preflight": preflight,
        "pre_dev": preflight + (local * impl.pre_bytes + pack * impl.copy_bytes) / hw.memory_bandwidth,
        "mid_dev": pipeline_seconds(compute, [c[0] for c in comm], [c[1] for c in comm]),
        "post_dev": local * impl.post_bytes / hw.memory_bandwidth,
        "pre_host": pre * hw.op_overhead,
        "mid_host": mid * hw.op_overhead,
        "post_host": post * hw.op_overhead,
    }


def _predict_plan(
    plan: Plan,
    hw: Hardware,
    impl: Implementation,
    ns_steps: int,
    itemsize: int,
    nodes: Sequence[int],
    algorithm: str = "standard",
    check_ranks: int = 0,
) -> tuple[float, dict[str, float]]:
    """The step's seconds on ``plan`` (group rank r on node ``nodes[r]``), and its phases."""
    p = _phases(plan, hw, impl, ns_steps, itemsize, nodes, algorithm, check_ranks)
    return _total(p, hw), p


def _total(p: dict[str, float], hw: Hardware) -> float:
    if hw.async_host:  # the host runs ahead of the device; its post work hides behind the exchange
        return max(p["pre_dev"], p["pre_host"]) + max(
            p["mid_dev"] + p["post_dev"], p["mid_host"] + p["post_host"]
        )
    return sum(p[k] for k in ("pre_dev", "mid_dev", "post_dev", "pre_host", "mid_host", "post_host"))


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
    if splits.split_count and _total(q, hw) < _total(p, hw):
        return _total(q, hw), q
    return _total(p, hw), p


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
) -> Prediction:
    """Predict one step. ``mode``: "owner", "gather", or "redundant" (Newton-Schulz of every matrix
    on one device and nothing else: the cost every rank pays when each orthogonalizes everything).
    ``ns_algorithm``: the optimizer's, "standard" or "gram" (``newton_schulz.orthogonalize_flops``).
    ``world_size`` ranks shard each matrix; ``replicas`` > 1 is HSDP, mesh rank ``r`` in replica
    ``r // world_size`` (a node holds whole shard groups when they fit). ``owners``: ``"replica"``
    (each replica runs one shard group's step at the same time), ``"mesh"`` (owners among all
    ``replicas * world_size`` ranks) or ``"auto"`` (the faster of the two). ``split``: run the
    largest matrices' Newton-Schulz over a few ranks where that pays (``planning/split.py``; the
    optimizer's ``ns_split="auto"``). Computed once per equal arguments (``planning/memo.py``)."""
    hw = hw or Hardware.h200()
    shape_key = cast("tuple[Shape, ...]", tuple(tuple(s) for s in shapes))
    if replicas == 1 and mode != "redundant":
        owners = "replica"  # one replica group: every owner choice is the replica's (one cache entry)
    key = (shape_key, world_size, hw, mode, impl, ns_steps, itemsize, ns_algorithm, replicas, owners, split)
    return once(_predict_cached, _predict, key)


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
) -> Prediction:
    """``predict`` with every argument given (``hw`` too)."""
    if mode == "redundant":
        config = _ns_config(ns_steps, itemsize, ns_algorithm)
        ns = sum(orthogonalize_flops(s, config) for s in shapes) / hw.matmul_flops
        return Prediction(mode, world_size, ns, ns, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 1.0, replicas, owners)
    if replicas > 1 and owners == "auto":
        args = (shapes, world_size, hw, mode, impl, ns_steps, itemsize, ns_algorithm, replicas)
        both = [once(_predict_cached, _predict, (*args, o, split)) for o in ("mesh", "replica")]
        return min(both, key=lambda p: p.total)
    across = replicas > 1 and owners == "mesh" and mode == "owner"
    if across:
        plan = hsdp_plan(shapes, world_size, replicas, mode, impl.max_round_bytes)
    else:
        plan = sharded_plan(shapes, world_size, mode, impl.max_round_bytes)
    nodes = [r // hw.gpus_per_node for r in range(plan.group_size)]
    checked = world_size * replicas  # the check's row is summed over every rank of the step
    total, p = _predict_plan(plan, hw, impl, ns_steps, itemsize, nodes, ns_algorithm, checked)
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
    mesh = _predict_plan(build_plan(entries, n, max_round_bytes=impl.max_round_bytes), hw, impl, ns_steps,
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
            priced[key] = _predict_plan(plan, hw, impl, ns_steps, itemsize, here, check_ranks=n)[0]
    return max(priced.values())
