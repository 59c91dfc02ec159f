"""The eager ops one optimizer step issues on the host, counted from a rank's routes the way the code
issues them: each is a kernel launch (or at least a dispatch) on a GPU, so this is the step's host
term. Pure arithmetic over the plan layer; ``tests/test_host_model.py`` holds it to the profiler's
count of top-level ``aten::`` ops (``benchmarks/bench_host.py``'s model, 2 and 4 ranks, both paths).

What each event costs, read from the code (``functional.py``, ``elementwise.py``,
``_sharding/exchange.py``, ``_sharding/comm.py``, ``step_checks.py``, ``newton_schulz.py``):

- per local Muon parameter: its Newton-Schulz input allocated (1); per member of a round, its piece
  cut (1);
- per bucket of elementwise work: momentum 6 multi-tensor calls (4 without Nesterov), the update 4
  (3 without weight decay), AdamW 14, plus 2 per AdamW step (the counters' add and read);
- per round with an all-to-all: the send buffer (one reshape per piece and a cat), a receive buffer,
  per shape stack an allocation and an unbind, per own block a slice and a copy, per strided run
  two views and a copy; back: a send buffer, 3 per run, a receive buffer and a split, a slice per
  own block, a slice and a view per received piece;
- per Newton-Schulz call: cast, norm, clamp, divide, then per iteration the Gram product's
  transpose and product and two ``addmm`` (a batched call adds a stack and an unbind);
- per round: the update's sum of squares that ``Muon.metrics`` reads, ``METRICS_ROUND``;
- per step: the checks (flags, one sum per scope, the decisions), ``CHECK_OPS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._sharding.plan import Plan
from .._sharding.routes import Inbound, Outbound, build_routes

__all__ = ["CHECK_OPS", "CHECK_SCOPE_OPS", "StepShape", "step_ops"]

NS_FIXED, NS_PER_ITERATION = 4, 4
MOMENTUM_BUCKET, UPDATE_BUCKET, ADAMW_BUCKET, ADAMW_STEP = 6, 4, 14, 2
METRICS_ROUND = 11  # the update's sum of squares for Muon.metrics, per round (profiled)
CHECK_OPS, CHECK_SCOPE_OPS = (
    61,
    8,
)  # step_checks.run: one scope (profiled: the flags, the sum, the decisions), each more


@dataclass(frozen=True)
class StepShape:
    """What the routes do not say: the local parameters and buckets, and the options that change
    the op count."""

    muon_params: int
    muon_buckets: int = 1
    adamw_params: int = 0
    adamw_buckets: int = 1
    batched: bool = True
    ns_steps: int = 5
    nesterov: bool = True
    weight_decay: bool = True
    momentum_ops: int = MOMENTUM_BUCKET  # per bucket (a fused kernel would be 1)
    update_ops: int = UPDATE_BUCKET


def _ns_call(ns_steps: int) -> int:
    return NS_FIXED + NS_PER_ITERATION * ns_steps


def _inbound(route: Inbound, batched: bool, ns_steps: int) -> int:
    ops = 0
    if route.collective:
        chunks = sum(len(s) for s in route.sends)
        ops += (chunks + 1 if chunks else 1) + 1  # pack (reshapes and a cat, or an empty), receive
        ops += 2 * len(route.stacks) + len(route.parts) + len(route.copies)
        ops += 2 * len(route.own) + 3 * len(route.runs) + 6 * len(route.loose)
    for _, members in route.stacks:
        ops += 2 + _ns_call(ns_steps) if batched and len(members) > 1 else len(members) * _ns_call(ns_steps)
    return ops


def _outbound(route: Outbound) -> int:
    if not route.collective:
        return len(route.empty) + len(route.own)
    ops = 1 + 3 * len(route.send_runs) + 4 * len(route.send_loose) + 2  # send, receive, split
    return ops + len(route.own) + 2 * len(route.received)


def step_ops(plan: Plan, rank: int, shape: StepShape, *, scopes: int = 1) -> dict[str, int]:
    """Top-level ops of one step on group rank ``rank`` of ``plan``, by phase."""
    routes = build_routes(plan, rank)
    momentum = shape.momentum_ops - (0 if shape.nesterov else 2)
    update = shape.update_ops - (0 if shape.weight_decay else 1)
    pre = shape.muon_params + shape.muon_buckets * momentum
    mid = sum(len(r.members) + _inbound(r.inbound, shape.batched, shape.ns_steps) for r in routes)
    mid += sum(_outbound(r.outbound) for r in routes)
    post = shape.muon_params + len(routes) * (
        shape.muon_buckets * update + METRICS_ROUND
    )  # a scaled update each
    adamw = ADAMW_STEP + shape.adamw_buckets * ADAMW_BUCKET if shape.adamw_params else 0
    checks = CHECK_OPS + CHECK_SCOPE_OPS * (scopes - 1)
    return {"checks": checks, "pre": pre, "exchange": mid, "post": post, "adamw": adamw}
