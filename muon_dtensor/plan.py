"""Who orthogonalizes which matrix, and what is batched with what: plain frozen data, pure functions.

The plan is built from global shapes and layouts only, so every rank builds the same plan without
talking to the others, and a plan for 1,024 ranks can be built and checked in a unit test.

Owners balance Newton-Schulz flops with the longest-processing-time rule (Graham, 1969): matrices in
order of decreasing cost, each to the least-loaded rank, ties to the lower rank. Same-shape matrices
with the same layout form one batch: one all-to-all carries the batch to its owners, each owner
orthogonalizes its share as one batched product, one all-to-all brings the results back.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .layout import Block, block_numel
from .newton_schulz import ns_flops

__all__ = ["EVERYONE", "Batch", "MatrixEntry", "Plan", "build_plan"]

# Owner value meaning "every rank of the group computes this matrix" (gather mode).
EVERYONE = -1


@dataclass(frozen=True)
class MatrixEntry:
    """One matrix to orthogonalize: its global shape and the block each group rank holds."""

    shape: tuple[int, int]
    blocks: tuple[Block, ...]
    batch_key: Hashable


@dataclass(frozen=True)
class Batch:
    members: tuple[int, ...]  # indices into the plan's entries, ascending
    owners: tuple[int, ...]  # owner group rank per member, or EVERYONE

    def owned_by(self, rank: int) -> tuple[int, ...]:
        return tuple(m for m, o in zip(self.members, self.owners) if o in (rank, EVERYONE))


@dataclass(frozen=True)
class Plan:
    group_size: int
    mode: str
    entries: tuple[MatrixEntry, ...]
    batches: tuple[Batch, ...]
    loads: tuple[int, ...]  # Newton-Schulz flops per iteration, per group rank

    @property
    def imbalance(self) -> float:
        """Most loaded rank over the mean; 1.0 is perfect."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def owner_of(self, index: int) -> int:
        for batch in self.batches:
            if index in batch.members:
                return batch.owners[batch.members.index(index)]
        raise KeyError(index)

    def bytes_sent(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` sends to other ranks in one step under this plan (both directions)."""
        total = 0
        for batch in self.batches:
            for member, owner in zip(batch.members, batch.owners):
                blocks = self.entries[member].blocks
                if owner == EVERYONE:
                    total += (self.group_size - 1) * block_numel(blocks[rank])
                elif owner == rank:
                    total += sum(block_numel(b) for r, b in enumerate(blocks) if r != rank)
                else:
                    total += block_numel(blocks[rank])
        return total * itemsize


def _assign_owners(entries: Sequence[MatrixEntry], group_size: int) -> tuple[list[int], list[int]]:
    costs = [ns_flops(e.shape) for e in entries]
    order = sorted(range(len(entries)), key=lambda i: (-costs[i], i))
    heap = [(0, rank) for rank in range(group_size)]
    owners = [0] * len(entries)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    loads = [0] * group_size
    for load, rank in heap:
        loads[rank] = load
    return owners, loads


def build_plan(entries: Sequence[MatrixEntry], group_size: int, mode: str = "owner") -> Plan:
    """Assign an owner to every matrix and batch same-key matrices together.

    ``mode="owner"``: each matrix once, on its owner. ``mode="gather"``: every rank computes every
    matrix (the redundant strategy, kept for comparison).
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
        total = sum(ns_flops(e.shape) for e in entries)
        loads = [total] * group_size
    by_key: dict[Hashable, list[int]] = {}
    for i, e in enumerate(entries):
        by_key.setdefault(e.batch_key, []).append(i)
    batches = tuple(
        Batch(members=tuple(m), owners=tuple(owners[i] for i in m)) for m in by_key.values()
    )
    return Plan(group_size, mode, tuple(entries), batches, tuple(loads))
