"""Who orthogonalizes which matrix, and what is batched with what: plain frozen data, pure functions.

The plan is built from global shapes and layouts only, so every rank builds the same plan without
talking to the others, and a plan for 1,024 ranks can be built and checked in a unit test.

Owners balance Newton-Schulz flops with the longest-processing-time rule (Graham, 1969): matrices in
order of decreasing cost, each to the least-loaded rank, ties to the lower rank. Matrices travel in
rounds: one all-to-all carries a round's blocks to their owners, each owner orthogonalizes its
same-shape matrices of the round together, one all-to-all brings the results back.
``max_round_bytes`` splits a step into several rounds: that bounds the transient memory, and
exchange.run_plan overlaps one round's all-to-alls with another's Newton-Schulz. The optimizer's
default is ``DEFAULT_ROUND_BYTES``; ``None`` makes the step one round.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import Block, block_numel
from ..newton_schulz import ns_flops

__all__ = ["DEFAULT_ROUND_BYTES", "EVERYONE", "MatrixEntry", "Plan", "Round", "build_plan"]

# Owner value meaning "every rank of the group computes this matrix" (gather mode).
EVERYONE = -1
# Full matrices (bf16) per exchange round by default: 16% faster than one round and a quarter of its
# exchange buffers on the 8 x 512 benchmark set (docs/benchmarks.md, bench_rounds.py).
DEFAULT_ROUND_BYTES = 4 << 20


@dataclass(frozen=True)
class MatrixEntry:
    """One matrix to orthogonalize: its global shape and the block each group rank holds."""

    shape: tuple[int, int]
    blocks: tuple[Block, ...]
    # Every rank holds the whole matrix (replicated DTensor, DDP): the owner needs no input from
    # the others and only sends the result.
    replicated: bool = False

    @property
    def holder(self) -> int | None:
        """The one rank that holds this matrix whole while the others hold nothing (an expert of
        an expert-parallel stack), or None. Such a matrix needs no communication at all."""
        full = [r for r, b in enumerate(self.blocks) if block_numel(b) == self.shape[0] * self.shape[1]]
        if len(full) == 1 and not any(block_numel(b) for r, b in enumerate(self.blocks) if r != full[0]):
            return full[0]
        return None


@dataclass(frozen=True)
class Round:
    """One exchange: every member's blocks go to its owner in one all-to-all and come back in one."""

    members: tuple[int, ...]  # indices into the plan's entries
    owners: tuple[int, ...]  # owner group rank per member, or EVERYONE

    def owned_by(self, rank: int) -> tuple[int, ...]:
        return tuple(m for m, o in zip(self.members, self.owners) if o in (rank, EVERYONE))


@dataclass(frozen=True)
class Plan:
    group_size: int
    mode: str
    entries: tuple[MatrixEntry, ...]
    rounds: tuple[Round, ...]
    loads: tuple[int, ...]  # Newton-Schulz flops per iteration, per group rank

    @property
    def imbalance(self) -> float:
        """Most loaded rank over the mean; 1.0 is perfect."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def bytes_sent(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` sends to other ranks in one step under this plan (both directions)."""
        total = 0
        for r in self.rounds:
            for member, owner in zip(r.members, r.owners):
                entry = self.entries[member]
                blocks = entry.blocks
                if owner == EVERYONE:
                    total += 0 if entry.replicated else (self.group_size - 1) * block_numel(blocks[rank])
                elif owner == rank:
                    total += sum(block_numel(b) for r, b in enumerate(blocks) if r != rank)
                elif not entry.replicated:
                    total += block_numel(blocks[rank])
        return total * itemsize


def _assign_owners(entries: Sequence[MatrixEntry], group_size: int) -> tuple[list[int], list[int]]:
    costs = [ns_flops(e.shape) for e in entries]
    owners = [0] * len(entries)
    pinned = [0] * group_size
    for i, e in enumerate(entries):  # a matrix held whole by one rank stays there
        if e.holder is not None:
            owners[i] = e.holder
            pinned[e.holder] += costs[i]
    order = sorted((i for i, e in enumerate(entries) if e.holder is None), key=lambda i: (-costs[i], i))
    heap = [(pinned[rank], rank) for rank in range(group_size)]
    heapq.heapify(heap)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    loads = [0] * group_size
    for load, rank in heap:
        loads[rank] = load
    return owners, loads


def _rounds(
    entries: Sequence[MatrixEntry], order: list[int], max_bytes: int | None, group_size: int
) -> list[list[int]]:
    """Consecutive pieces of ``order`` (decreasing cost) whose full matrices (2 bytes an element)
    fit ``max_bytes``, but never fewer than ``group_size`` matrices: consecutive matrices in this
    order go to different owners, so every rank has work in every round and none waits idle."""
    if max_bytes is None:
        return [sorted(order)]
    rounds: list[list[int]] = [[]]
    size = 0
    for i in order:
        nbytes = 2 * entries[i].shape[0] * entries[i].shape[1]
        if len(rounds[-1]) >= group_size and size + nbytes > max_bytes:
            rounds.append([])
            size = 0
        rounds[-1].append(i)
        size += nbytes
    return [sorted(r) for r in rounds]


def build_plan(
    entries: Sequence[MatrixEntry],
    group_size: int,
    mode: str = "owner",
    *,
    max_round_bytes: int | None = None,
) -> Plan:
    """Assign an owner to every matrix and split the matrices into exchange rounds.

    ``mode="owner"``: each matrix once, on its owner. ``mode="gather"``: every rank computes every
    matrix (the redundant strategy, kept for comparison). Rounds take matrices in decreasing cost,
    so each round mixes owners the way the whole plan does.
    """
    if mode not in ("owner", "gather"):
        raise ValueError(f"mode must be 'owner' or 'gather' but is: {mode!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 but is: {group_size}")
    for e in entries:
        if len(e.blocks) != group_size:
            raise ValueError(f"entry has {len(e.blocks)} blocks for a group of {group_size}")
    if mode == "owner":
        owners, loads = _assign_owners(entries, group_size)
    else:
        owners = [EVERYONE] * len(entries)
        loads = [sum(ns_flops(e.shape) for e in entries)] * group_size
    order = sorted(range(len(entries)), key=lambda i: (-ns_flops(entries[i].shape), i))
    rounds = tuple(
        Round(members=tuple(r), owners=tuple(owners[i] for i in r))
        for r in _rounds(entries, order, max_round_bytes, group_size)
        if r
    )
    return Plan(group_size, mode, tuple(entries), rounds, tuple(loads))
