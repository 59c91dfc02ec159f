"""The eager ops one optimizer step issues on the host, counted from a rank's routes the way the code
issues them: each is a kernel launch (or at least a dispatch) on a GPU, so this is the step's host
term. Pure arithmetic over the plan layer; ``tests/planning/test_host_model.py`` holds it to the profiler's
count of top-level ``aten::`` ops (``benchmarks/bench_host.py``'s model, 2 and 4 ranks, both paths).

What each event costs, read from the code (``functional.py``, ``elementwise.py``,
``sharding/runtime/exchange.py``, ``sharding/runtime/comm.py``, ``step_checks.py``, ``newton_schulz.py``):

- per trailing shape of the local Muon parameters: their Newton-Schulz inputs allocated at once
  (an allocation and a split; 1 for a shape met once), and so the scaled updates of each round; a
  whole-matrix piece needs no cut;
- per bucket of elementwise work: momentum 6 multi-tensor calls (4 without Nesterov), the update 4
  (3 without weight decay), AdamW 14, plus 2 per AdamW step (the counters' add and read);
- per round with an all-to-all: the send buffer (one cat per run of same-width pieces, members
  ordered by shape), a receive buffer, per shape stack an allocation and an unbind, per batch of a
  stack's own blocks a view, an unbind and one multi-tensor copy (2 for one block), per strided run
  (a run spans a stack's members) two views and a copy; back: a send buffer, 3 per run (3 per member
  when the results are not one batched tensor), a receive buffer and a split, a view and an unbind
  per batch of own blocks, a slice, a view and a split per source's run of same-width pieces;
- per Newton-Schulz call: cast, norm, clamp, divide, then per iteration the Gram product's
  transpose and product and two ``addmm`` (a batched call adds a stack and an unbind);
- per round: the update's sum of squares that ``Muon.metrics`` reads, ``METRICS_ROUND``;
- per piece of a parameter that is not one whole matrix (experts, heads): its cut and the result's
  placement (``view_ops``), and per such parameter its update's buffer;
- per step: the checks (a small sum per scope), ``CHECK_OPS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..sharding.plan.blocks import Block, block_numel, block_shape
from ..sharding.plan.build import Plan
from ..sharding.plan.memory import bucket_sizes
from ..sharding.plan.routes import Inbound, Outbound, OwnBatch, build_routes
from ..sharding.plan.runs import segments
from ..sharding.plan.views import LocalCut

__all__ = [
    "CHECK_OPS",
    "CHECK_SCOPE_OPS",
    "PAIR_STEP_OPS_SIMULATED",
    "StepShape",
    "butterfly_ops",
    "step_ops",
    "view_ops",
]

NS_FIXED, NS_PER_ITERATION = 4, 4
MOMENTUM_BUCKET, UPDATE_BUCKET, ADAMW_BUCKET, ADAMW_STEP = 6, 4, 14, 2
METRICS_ROUND = 11  # the update's sum of squares for Muon.metrics, per round (profiled)
# step_checks.run, profiled: per scope the head's tensor (4), its sum (2) and its read (2); the
# flags' tensors only when some rank's gradients differ or are bad (an error follows)
CHECK_OPS, CHECK_SCOPE_OPS = 8, 8
# runtime.comm._pair_reduce on a fake group, profiled: a view and the rows' buffer per butterfly step
# (its all-gather is a collective, as the all-reduce it replaces: neither is a host op here; a real
# group adds the rows' views and the add on the main thread, and the gather's copies on gloo's)
PAIR_STEP_OPS_SIMULATED = 2


@dataclass(frozen=True)
class StepShape:
    """What the routes do not say: the local parameters and buckets, and the options that change
    the op count."""

    muon_params: int
    muon_buckets: int = 1
    bucket_elements: int | None = None  # a round's update buckets: its local elements over this (None: 1)
    adamw_params: int = 0
    adamw_buckets: int = 1
    batched: bool = True
    ns_steps: int = 5
    nesterov: bool = True
    weight_decay: bool = True
    momentum_ops: int = MOMENTUM_BUCKET  # per bucket (a fused kernel would be 1)
    update_ops: int = UPDATE_BUCKET
    # CPU: elementwise.CPU_PIECE_ELEMENTS. Buckets are then counted as elementwise.buckets makes
    # them, and a tensor above it is cut into pieces of it: a view and a slice per piece and list
    cpu_piece: int | None = None
    newton_schulz: bool = True  # False: an orthogonalize_fn that issues no op (plan --rehearse --skip-ns)


def _ns_call(ns_steps: int) -> int:
    return NS_FIXED + NS_PER_ITERATION * ns_steps


def _allocs(shapes: list[tuple[int, ...]]) -> int:
    """``elementwise.empty_like_all`` for tensors of ``shapes`` (one dtype and device): one
    allocation and a split per trailing shape, an allocation alone for a shape met once."""
    groups: dict[tuple[int, ...], int] = {}
    for shape in shapes:
        groups[shape[1:]] = groups.get(shape[1:], 0) + 1
    return sum(1 if n == 1 else 2 for n in groups.values())


def _pack(cols: list[int | None]) -> int:
    """``comm._cat_flat`` over pieces of these widths: one cat per same-width run, else a reshape
    each; a buffer and a slice per segment when there are several."""
    if not cols:
        return 1  # an empty send buffer
    parts = segments(cols)
    each = [2 if c is not None else stop - first + 1 for first, stop, c in parts]
    return each[0] if len(parts) == 1 else 1 + sum(n + 1 for n in each)


def _own_in(batches: tuple[OwnBatch, ...]) -> int:
    return sum(3 if len(members) > 1 else 2 for members, _ in batches)


def _own_out(batches: tuple[OwnBatch, ...], stacked: set[int]) -> int:
    """A view and an unbind per batch of stacked results, else a slice each."""
    return sum(2 if len(ms) > 1 and ms[0] in stacked else len(ms) for ms, _ in batches)


def _inbound(plan: Plan, rank: int, route: Inbound, batched: bool, ns_steps: int) -> int:
    ops = 0
    if route.collective:
        sent = [m for per_dest in route.sends for m in per_dest]
        ops += _pack([_piece_cols(plan.entries[m].blocks[rank]) for m in sent]) + 1  # and receive
        ops += 2 * len(route.stacks) + len(route.parts) + len(route.copies)
        ops += _own_in(route.own_batches) + 3 * len(route.runs) + 6 * len(route.loose)
    for _, members in route.stacks if ns_steps >= 0 else ():
        ops += 2 + _ns_call(ns_steps) if batched and len(members) > 1 else len(members) * _ns_call(ns_steps)
    return ops


def _piece_cols(block: Block) -> int:
    """Columns of this rank's piece of a matrix as ``View.cut`` makes it: an empty block is (0, 0)."""
    shape = block_shape(block)
    return shape[1] if math.prod(shape) else 0


def _outbound(route: Outbound, stacked: set[int]) -> int:
    if not route.collective:
        return len(route.empty) + _own_out(route.own_batches, stacked)
    runs = sum(3 if r.member in stacked else 3 * len(r.members) for r in route.send_runs)
    ops = 1 + runs + 4 * len(route.send_loose) + 2  # send, receive, split
    received = sum(3 if len(b[3]) > 1 else 2 for b in route.received_batches)
    return ops + _own_out(route.own_batches, stacked) + received


def _stacked(route: Inbound, batched: bool) -> set[int]:
    """Members whose results come back as one batched tensor (a batched call's ``unbind``)."""
    return {m for _, ms in route.stacks if batched and len(ms) > 1 for m in ms}


def _round_buckets(plan: Plan, rank: int, members: tuple[int, ...], shape: StepShape) -> int:
    """The update's buckets in one round: over this rank's pieces of the round's results only."""
    numels = [block_numel(plan.entries[m].blocks[rank]) for m in members]
    if shape.cpu_piece is not None:
        return max(1, len(bucket_sizes(numels, cpu=True, cpu_piece=shape.cpu_piece)))
    if shape.bucket_elements is None:
        return 1
    return max(1, -(-sum(numels) // shape.bucket_elements))


def _cuts(numels: list[int], piece: int | None, lists: int) -> int:
    """``elementwise.buckets`` on CPU: a view and a slice per piece of each tensor above ``piece``
    elements, in each of ``lists`` aligned lists (the momentum's 3, the update's 2)."""
    if piece is None:
        return 0
    return 2 * lists * sum(-(-n // piece) for n in numels if n > piece)


def _bucket_allocs(shapes: list[tuple[int, ...]], piece: int) -> int:
    """``elementwise.apply_results`` on CPU: its scaled temporaries allocated per bucket, over the
    bucket's pieces (a cut piece is flat), where one bucket per round allocates them once."""
    bucket: list[tuple[int, ...]] = []
    allocs = size = 0
    for s in shapes:
        n = math.prod(s)
        for part in [(min(piece, n - a),) for a in range(0, n, piece)] if n > piece else [s]:
            if size and size + math.prod(part) > piece:
                allocs, bucket, size = allocs + _allocs(bucket), [], 0
            bucket.append(part)
            size += math.prod(part)
    return allocs + (_allocs(bucket) if bucket else 0)


def _momentum(numels: list[int], shape: StepShape) -> int:
    """The momentum's ops (``elementwise.nesterov_inputs``): per bucket, and the CPU's cuts."""
    ops = shape.momentum_ops - (0 if shape.nesterov else 2)
    if shape.cpu_piece is None:
        return shape.muon_buckets * ops
    return len(bucket_sizes(numels, cpu=True, cpu_piece=shape.cpu_piece)) * ops + _cuts(
        numels, shape.cpu_piece, 3
    )


def step_ops(plan: Plan, rank: int, shape: StepShape, *, scopes: int = 1) -> dict[str, int]:
    """Top-level ops of one step on group rank ``rank`` of ``plan``, by phase."""
    routes = build_routes(plan, rank)
    update = shape.update_ops - (0 if shape.weight_decay else 1)
    # whole-matrix parameters: a piece is the local tensor itself (no cut), its result its update
    local = [block_shape(e.blocks[rank]) for e in plan.entries]
    numels = [block_numel(e.blocks[rank]) for e in plan.entries]
    pre = (_allocs(local) if shape.muon_params else 0) + _momentum(numels, shape)
    pre += numels.count(0)  # View.cut: an empty tensor for each matrix this rank holds none of
    ns_steps = shape.ns_steps if shape.newton_schulz else -1  # -1: no Newton-Schulz op counted
    mid = sum(_inbound(plan, rank, r.inbound, shape.batched, ns_steps) for r in routes)
    mid += sum(_outbound(r.outbound, _stacked(r.inbound, shape.batched)) for r in routes)
    shapes = [[block_shape(plan.entries[m].blocks[rank]) for m in r.members] for r in routes]
    results = [_allocs(s) if shape.cpu_piece is None else _bucket_allocs(s, shape.cpu_piece) for s in shapes]
    post = sum(results) + sum(_round_buckets(plan, rank, r.members, shape) * update for r in routes)
    post += sum(_cuts([numels[m] for m in r.members], shape.cpu_piece, 2) for r in routes)
    post += len(routes) * METRICS_ROUND
    adamw = ADAMW_STEP + shape.adamw_buckets * ADAMW_BUCKET if shape.adamw_params else 0
    checks = CHECK_OPS + CHECK_SCOPE_OPS * (scopes - 1)
    return {"checks": checks, "pre": pre, "exchange": mid, "post": post, "adamw": adamw}


def view_ops(cut: LocalCut, local_rows: int, assembled: bool) -> int:
    """Ops of ``View.cut`` on a non-empty piece beyond what ``step_ops`` counts (an expert's select, a
    slice or a cat of rows that are not all the local ones, and of columns), and where the
    parameter is assembled from several matrices (an expert stack, heads) ``View.place`` writing
    the result into its update: a select, a view and a slice and copy per rectangle (profiled)."""
    expert = 1 if cut.expert is not None else 0
    rows = 0 if cut.rows == ((0, local_rows),) else _intervals(cut.rows)
    cols = 0 if cut.cols is None else _intervals(cut.cols)
    place = expert + 1 + 2 * len(cut.rows) * len(cut.cols or ((0, 0),)) if assembled else 0
    return expert + rows + cols + place


def _intervals(intervals: tuple[tuple[int, int], ...]) -> int:
    """A slice for one interval; a slice each and a cat for several."""
    return 1 if len(intervals) == 1 else len(intervals) + 1


def butterfly_ops(steps: int, pair_ops: int = PAIR_STEP_OPS_SIMULATED) -> int:
    """Host ops the check's butterfly (``grid.butterfly_steps``: ``steps`` two-rank steps) issues
    beyond ``CHECK_OPS``; 0 where it sums in one all-reduce. Its all-gathers, like that all-reduce,
    are collectives (``Prediction.collectives``), not host ops: the profiler's ``c10d::`` events."""
    return pair_ops * steps
