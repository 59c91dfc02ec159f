"""Which matrices to split, over how many ranks, and the owner loads that result.

A split runs one matrix's Newton-Schulz over k ranks (``split_ns.py``, in the step as ``ns_split``):
each rank holds a column block of the wide form (m <= n) and, per iteration, computes its partial
Gram matrix ``X_i X_i^T`` (2 m^2 n / k flops), sums it with the others' by a reduce-scatter over
rows, gathers ``A``, computes its m/k rows of ``b A + c A A`` (2 m^3 / k), gathers them and
updates its block (2 m^2 n / k). So per rank and iteration ``split_ns.split_flops`` flops and three
exchanges of ``(k - 1) / k m^2`` elements per rank; two small ones for the norm.

The k ranks of a split are k consecutive ranks aligned to k, with ``k`` dividing the node size, so
the exchanges stay on NVLink. The model prices them as k-member all-to-alls; the step runs them as
all-to-alls over the whole exchange group in which the other ranks send nothing. Splitting pays
where one matrix's whole iteration is longer than the mean load per rank, and sometimes where a
few large matrices per rank pack badly: for each cap K on k (1, 2, 4, 8), ``plan_splits`` picks,
per shape longer than the mean, the smallest k <= K whose time per rank fits under the mean (or
the fastest), balances, keeps the plan with the shortest makespan (no split on a tie), also
tries one k for every shape longer than the mean, then from the best of these tries every other k
for each shape in turn and keeps a change only where the makespan falls.

The balance is LPT with gangs: tasks longest first; a whole matrix goes to the least-loaded rank,
a split one to the aligned group of k ranks whose busiest rank is least loaded, and occupies all k
from that rank's load on (they run the iteration in lockstep). Pure arithmetic and frozen data;
``ns_split="auto"`` takes its k per shape from here (``optim/policy.py``), and the runtime plan
(``sharding/plan/build.py``) places the gangs itself.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..numerics.newton_schulz import DEFAULT_COEFFICIENTS, NSConfig, orthogonalize_flops
from ..numerics.split_ns import split_flops
from ..sharding.plan.build import Plan
from .hardware import Hardware
from .links import Links, block_numels, owned, pipeline_seconds
from .memo import once

__all__ = [
    "SplitPlan",
    "alltoall_seconds",
    "plan_splits",
    "split_exchange_seconds",
    "split_links",
    "split_seconds",
]

Shape = tuple[int, int]


def alltoall_seconds(nbytes: float, k: int, hw: Hardware) -> float:
    """An exchange among ``k`` ranks of one node in which each sends ``(k - 1) / k`` of ``nbytes``
    to the others (a reduce-scatter or an all-gather of ``nbytes`` in all) on NVLink, plus one
    collective latency. Over one rank: nothing."""
    if k <= 1:
        return 0.0
    return hw.collective_latency + (k - 1) / k * nbytes / hw.intra_node_bandwidth


def split_seconds(
    shape: Sequence[int], k: int, hw: Hardware, *, steps: int = 5, itemsize: int = 2, packs: int = 2
) -> float:
    """Device seconds of one matrix's Newton-Schulz on each of its ``k`` ranks: the flops of
    ``split_ns.split_flops``, three exchanges of the m x m Gram matrix per iteration and two for the
    norm, and the copies (assemble this rank's block, pack the result ``packs - 1`` times,
    ``itemsize`` bytes each read and written) at the memory bandwidth."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    flops = split_flops(shape, k, steps) / hw.matmul_flops
    exchanges = 3 * steps * alltoall_seconds(m * m * itemsize, k, hw) + 2 * alltoall_seconds(4 * k, k, hw)
    copies = packs * m * math.ceil(n / k) * 2 * itemsize / hw.memory_bandwidth
    return flops + exchanges + copies


@dataclass(frozen=True)
class SplitPlan:
    """Per matrix (in ``shapes`` order): ``ks[i]`` ranks share it (1: whole, one owner) and
    ``ranks[i]`` are they; ``seconds[i]`` is its time on each of them. ``loads`` are each rank's
    busy seconds, gangs waiting for their busiest rank included."""

    world_size: int
    ks: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...]
    seconds: tuple[float, ...]
    loads: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.loads, default=0.0)

    @property
    def imbalance(self) -> float:
        """Busiest rank over the mean; 1.0 is perfect."""
        mean = sum(self.loads) / len(self.loads)
        return self.makespan / mean if mean else 1.0

    @property
    def split_count(self) -> int:
        return sum(k > 1 for k in self.ks)


def _whole_seconds(shape: Shape, hw: Hardware, config: NSConfig, itemsize: int, packs: int) -> float:
    """One owner, the whole matrix: what ``costmodel`` counts for it (Gram form where it pays)."""
    copies = packs * shape[0] * shape[1] * 2 * itemsize / hw.memory_bandwidth
    return orthogonalize_flops(shape, config) / hw.matmul_flops + copies


def _candidates(world_size: int, hw: Hardware, max_k: int | None) -> list[int]:
    """Split sizes: powers of two that divide the node size (exchanges on NVLink) and the group."""
    limit = min(hw.gpus_per_node, world_size, max_k or world_size)
    return [k for k in (2**i for i in range(1, 11)) if k <= limit and hw.gpus_per_node % k == 0]


def _gang_balance(
    seconds: Sequence[float], ks: Sequence[int], n: int
) -> tuple[list[tuple[int, ...]], list[float]]:
    """LPT with gangs (module docstring): the ranks of each task and every rank's load. A heap of
    (load, rank) finds the least-loaded rank, and one heap of (block's largest load, start) per gang
    size the least-loaded aligned block; entries a later assignment made stale are skipped."""
    loads = [0.0] * n
    heap = [(0.0, r) for r in range(n)]
    blocks = {k: _Blocks(k, n) for k in set(ks) if k > 1}
    ranks: list[tuple[int, ...]] = [()] * len(seconds)
    for i in sorted(range(len(seconds)), key=lambda j: (-seconds[j] * ks[j], j)):
        k = ks[i]
        if k == 1:
            while heap[0][0] != loads[heap[0][1]]:
                heapq.heappop(heap)
            group: tuple[int, ...] = (heap[0][1],)
        else:
            start = blocks[k].least(loads)
            group = tuple(range(start, start + k))
        begin = max(loads[r] for r in group)
        for r in group:
            loads[r] = begin + seconds[i]
            heapq.heappush(heap, (loads[r], r))
        for b in blocks.values():
            b.changed(group, loads)
        ranks[i] = group
    return ranks, loads


class _Blocks:
    """The aligned blocks of ``k`` ranks (starts 0, k, 2k, ...) in a heap by (largest load, start):
    the block ``min(starts, key=(max load, start))`` picks, without a scan over every rank."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.heap = k, [(0.0, s) for s in range(0, n - k + 1, k)]
        self.n_blocks = len(self.heap)

    def _top(self, start: int, loads: Sequence[float]) -> float:
        return max(loads[start : start + self.k])

    def least(self, loads: Sequence[float]) -> int:
        while self.heap[0][0] != self._top(self.heap[0][1], loads):
            heapq.heappop(self.heap)
        return self.heap[0][1]

    def changed(self, group: Sequence[int], loads: Sequence[float]) -> None:
        for start in {(r // self.k) * self.k for r in group}:
            if start // self.k < self.n_blocks:
                heapq.heappush(self.heap, (self._top(start, loads), start))


def _choose_k(whole: float, by_k: dict[int, float], mean: float) -> int:
    """The smallest k whose time fits under the mean load, else the fastest; 1 when whole fits."""
    if whole <= mean or not by_k:
        return 1
    fits = [k for k in sorted(by_k) if by_k[k] <= mean]
    k = fits[0] if fits else min(by_k, key=lambda j: (by_k[j], j))
    return k if by_k[k] < whole else 1


def plan_splits(
    shapes: Sequence[Shape],
    world_size: int,
    hw: Hardware | None = None,
    *,
    ns_steps: int = 5,
    itemsize: int = 2,
    ns_algorithm: str = "standard",
    max_k: int | None = None,
    packs: int = 2,
) -> SplitPlan:
    """Split decisions and balanced loads for ``shapes`` on ``world_size`` owner ranks (module
    docstring). ``packs``: copies per element on an owner (assemble + 1 per replica sent back).
    Equal arguments give the same (frozen) plan, computed once: the search re-balances the whole
    plan many times, seconds at 1,024 ranks."""
    if world_size < 1:
        raise ValueError(f"plan_splits: world_size must be >= 1 but is {world_size}")
    keys = tuple((int(s[0]), int(s[1])) for s in shapes)
    args = (keys, world_size, hw or Hardware.h200(), ns_steps, itemsize, ns_algorithm, max_k, packs)
    return once(_plan_splits_cached, _plan_splits, args)


def _plan_splits(
    keys: tuple[Shape, ...],
    world_size: int,
    hw: Hardware,
    ns_steps: int,
    itemsize: int,
    ns_algorithm: str,
    max_k: int | None,
    packs: int,
) -> SplitPlan:
    """``plan_splits`` with every argument given, shapes as int pairs."""
    dtype = torch.bfloat16 if itemsize == 2 else torch.float32
    config = NSConfig((DEFAULT_COEFFICIENTS,) * ns_steps, dtype=dtype, algorithm=ns_algorithm)
    distinct = sorted(set(keys))
    whole = {s: _whole_seconds(s, hw, config, itemsize, packs) for s in distinct}
    options = {
        s: {
            k: split_seconds(s, k, hw, steps=ns_steps, itemsize=itemsize, packs=packs)
            for k in _candidates(world_size, hw, max_k)
        }
        for s in distinct
    }
    caps = _candidates(world_size, hw, max_k)
    tries = [_choices(keys, world_size, whole, options, cap) for cap in [1, *caps]]
    tries += [_uniform(keys, world_size, whole, options, k) for k in caps]
    plans = [_plan(keys, world_size, chosen, whole, options) for chosen in tries]
    best = min(range(len(plans)), key=lambda i: plans[i].makespan)  # unsplit on a tie
    return _refine(keys, world_size, tries[best], plans[best], whole, options)


_plan_splits_cached = lru_cache(maxsize=256)(_plan_splits)


def _uniform(
    shapes: Sequence[Shape], n: int, whole: dict[Shape, float], options: dict[Shape, dict[int, float]], k: int
) -> dict[Shape, int]:
    """One k for every shape longer than the mean load (where it is faster split): a start the
    per-shape rule misses when several shapes gain only together."""
    mean = sum(whole[s] for s in shapes) / n
    return {s: k if whole[s] > mean and options[s][k] < whole[s] else 1 for s in whole}


def _refine(
    shapes: Sequence[Shape],
    n: int,
    chosen: dict[Shape, int],
    plan: SplitPlan,
    whole: dict[Shape, float],
    options: dict[Shape, dict[int, float]],
) -> SplitPlan:
    """Coordinate descent: each shape, largest first, tries every other k; a change is kept only
    if the makespan falls (the capped choices share one k rule that can miss, e.g. k = 4 for both
    70B's square and MLP matrices). A few passes; each re-balances the whole plan."""
    order = sorted(whole, key=lambda s: -whole[s])
    for _ in range(3):
        improved = False
        for shape in order:
            for k in [1, *options[shape]]:
                trial = {**chosen, shape: k}
                if k == chosen[shape] or (k > 1 and options[shape][k] >= whole[shape]):
                    continue
                candidate = _plan(shapes, n, trial, whole, options)
                if candidate.makespan < plan.makespan * (1 - 1e-9):
                    chosen, plan, improved = trial, candidate, True
        if not improved:
            break
    return plan


def _choices(
    shapes: Sequence[Shape],
    n: int,
    whole: dict[Shape, float],
    options: dict[Shape, dict[int, float]],
    cap: int,
) -> dict[Shape, int]:
    """Per shape, k up to ``cap`` (``_choose_k``) against the mean load, which splitting raises (the
    Gram exchanges): re-read until the choice is stable."""
    chosen = {s: 1 for s in whole}
    for _ in range(8):
        seconds = {s: options[s][k] if k > 1 else whole[s] for s, k in chosen.items()}
        mean = sum(seconds[s] * chosen[s] for s in shapes) / n
        capped = {s: {k: t for k, t in options[s].items() if k <= cap} for s in whole}
        update = {s: _choose_k(whole[s], capped[s], mean) for s in whole}
        if update == chosen:
            break
        chosen = update
    return chosen


def _plan(
    shapes: Sequence[Shape],
    n: int,
    chosen: dict[Shape, int],
    whole: dict[Shape, float],
    options: dict[Shape, dict[int, float]],
) -> SplitPlan:
    ks = [chosen[s] for s in shapes]
    seconds = [options[s][k] if k > 1 else whole[s] for s, k in zip(shapes, ks)]
    ranks, loads = _gang_balance(seconds, ks, n)
    return SplitPlan(n, tuple(ks), tuple(ranks), tuple(seconds), tuple(loads))


def split_links(
    plan: Plan, members: Sequence[int], splits: SplitPlan, itemsize: int, nodes: Sequence[int]
) -> tuple[Links, Links]:
    """One round's all-to-all to the owners and back with ``splits``' ranks: a matrix on k ranks
    takes 1/k of each source's block on each of them (a column block of the wide form, whichever
    way the matrix is sharded), and each of them sends 1/k of every rank's block back."""
    to_owners, back = Links.empty(plan.group_size), Links.empty(plan.group_size)
    for i in members:
        entry, group = plan.entries[i], splits.ranks[i]
        share = 1.0 / len(group)
        sizes = [numel * itemsize * share for numel in block_numels(entry.blocks)]
        if entry.replica_of is None:
            _spread(to_owners, back, sizes, group, nodes, entry.replicated)
            continue
        for r, nbytes in enumerate(sizes):
            for g in group:
                if g == r:
                    continue
                if not entry.replicated and entry.feeds(r, g):
                    to_owners.add(r, g, nbytes, nodes)
                back.add(g, r, nbytes, nodes)
    return to_owners, back


def _spread(
    to_owners: Links,
    back: Links,
    sizes: list[float],
    group: Sequence[int],
    nodes: Sequence[int],
    replicated: bool,
) -> None:
    """``split_links``' traffic of one matrix of one replica: every rank sends its share to each rank
    of the group but itself (none for a replicated matrix) and gets it back."""
    if not replicated:
        owned(to_owners, sizes, group, nodes, to_owner=True)
    owned(back, sizes, group, nodes, to_owner=False)


def split_exchange_seconds(
    plan: Plan,
    hw: Hardware,
    nodes: Sequence[int],
    *,
    ns_steps: int = 5,
    itemsize: int = 2,
    ns_algorithm: str = "standard",
) -> tuple[float, float, SplitPlan]:
    """Device seconds of the exchange phase of ``plan`` (owner mode) with splits, the seconds of its
    all-to-alls, and the splits:
    the plan's rounds, pipelined as ``links.pipeline_seconds`` does, each member computed and its
    traffic sent on the ranks ``plan_splits`` gives it (a round's compute: its busiest rank's sum)."""

    replicas = max((len(set(e.replica_of)) for e in plan.entries if e.replica_of is not None), default=1)
    shapes = [e.shape for e in plan.entries]
    splits = plan_splits(
        shapes,
        plan.group_size,
        hw,
        ns_steps=ns_steps,
        itemsize=itemsize,
        ns_algorithm=ns_algorithm,
        packs=1 + replicas,
    )
    compute, to_owner, back = [], [], []
    for rnd in plan.rounds:
        busy = [0.0] * plan.group_size
        for i in rnd.members:
            for r in splits.ranks[i]:
                busy[r] += splits.seconds[i]
        compute.append(max(busy))
        into, out = split_links(plan, rnd.members, splits, itemsize, nodes)
        to_owner.append(into.seconds(hw))
        back.append(out.seconds(hw))
    return pipeline_seconds(compute, to_owner, back), sum(to_owner) + sum(back), splits
