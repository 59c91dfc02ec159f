"""One plan's step priced phase by phase, as ``functional.muon_step`` runs it (``costmodel``'s
docstring): device and host seconds of the pre, mid and post phases on hardware ``Hardware``, for
an ``Implementation`` of the step's code. Pure arithmetic over the plan; ``costmodel.predict`` and
``compare_owners`` build the plans and add the phases up."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from ..numerics.newton_schulz import DEFAULT_COEFFICIENTS, NSConfig, orthogonalize_flops
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, Round
from .hardware import Hardware, check_collectives, check_seconds
from .host_ops import StepShape, step_ops
from .links import back_links, local_elements, pipeline_seconds, to_owner_links

__all__ = ["CURRENT", "CURRENT_CPU", "FUSED", "Implementation", "ns_config", "plan_seconds", "step_seconds"]


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


def ns_config(ns_steps: int, itemsize: int, algorithm: str) -> NSConfig:
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
    config = ns_config(ns_steps, itemsize, algorithm)
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


def plan_seconds(
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
    return step_seconds(p, hw), p


def step_seconds(p: dict[str, float], hw: Hardware) -> float:
    """The step's seconds from its phases: on an asynchronous device the host runs ahead."""
    if hw.async_host:  # the host runs ahead of the device; its post work hides behind the exchange
        return max(p["pre_dev"], p["pre_host"]) + max(
            p["mid_dev"] + p["post_dev"], p["mid_host"] + p["post_host"]
        )
    return sum(p[k] for k in ("pre_dev", "mid_dev", "post_dev", "pre_host", "mid_host", "post_host"))
