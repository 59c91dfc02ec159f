"""Bytes a plan moves per rank, within a replica and across replicas: pure arithmetic over the plan.

With HSDP (R replicas of S shards, N = R S ranks) and owners over the whole mesh, an owner reads
the blocks of its own replica and sends the result to every rank, so for a rank r of replica c
that owns the matrices O_r (B(m) bytes each, r's block b_r(m)):

    to owners   sent      sum over m not in O_r owned in c of b_r(m)            within c
                received  sum over m in O_r of B(m) - b_r(m)                    within c
    back        sent      sum over m in O_r of B(m) - b_r(m)                    within c
                          + (R - 1) B(m)                                        across
                received  sum over m not in O_r of b_r(m)                       within c if owned in c

For matrices of M bytes in all, sharded evenly, the mean over ranks is exact whatever the owners:
(M / N) (2 (S - 1) / S) within and M (R - 1) / N across, sent and received alike. Owners per
replica send 2 M (S - 1) / S^2 within and nothing across (``mean_traffic``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..sharding.plan.blocks import block_numel
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, EVERYONE, MatrixEntry, Plan
from .plans import hsdp_plan, sharded_plan
from .shapes import Shape

__all__ = ["Traffic", "mean_traffic", "rank_traffic", "traffic"]


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends and receives in one step, within its replica and across replicas."""

    sent_within: int = 0
    sent_across: int = 0
    received_within: int = 0
    received_across: int = 0

    @property
    def sent(self) -> int:
        return self.sent_within + self.sent_across

    @property
    def received(self) -> int:
        return self.received_within + self.received_across


def _same(entry: MatrixEntry, a: int, b: int) -> bool:
    return entry.replica_of is None or entry.replica_of[a] == entry.replica_of[b]


def _member(plan: Plan, entry: MatrixEntry, owner: int, me: int) -> tuple[int, int, int, int]:
    """(sent within, sent across, received within, received across) elements of one matrix."""
    n, mine = plan.group_size, block_numel(entry.blocks[me])
    others = [r for r in range(n) if r != me]
    if owner == EVERYONE:  # gather: every rank reads every block of its replica, nothing returns
        if entry.replicated:
            return 0, 0, 0, 0
        peers = [r for r in others if entry.feeds(me, r)]
        return mine * len(peers), 0, sum(block_numel(entry.blocks[r]) for r in peers), 0
    if owner == me:
        inbound = (
            0 if entry.replicated else sum(block_numel(entry.blocks[r]) for r in others if entry.feeds(r, me))
        )
        within = sum(block_numel(entry.blocks[r]) for r in others if _same(entry, r, me))
        across = sum(block_numel(entry.blocks[r]) for r in others if not _same(entry, r, me))
        return within, across, inbound, 0
    sent = mine if not entry.replicated and entry.feeds(me, owner) else 0
    return (sent, 0, mine, 0) if _same(entry, me, owner) else (sent, 0, 0, mine)


def traffic(plan: Plan, rank: int, itemsize: int) -> Traffic:
    """Bytes ``rank`` sends and receives under ``plan`` in one step, both directions; ``sent``
    equals ``plan.bytes_sent(rank, itemsize)``. A group of one, or a round whose every matrix is
    whole on its owner, moves nothing."""
    totals = [0, 0, 0, 0]
    for rnd in plan.rounds:
        if plan.group_size == 1:
            break
        for member, owner in zip(rnd.members, rnd.owners):
            entry = plan.entries[member]
            if plan.mode == "owner" and entry.holder == owner:
                continue
            for i, v in enumerate(_member(plan, entry, owner, rank)):
                totals[i] += v * itemsize
    return Traffic(*totals)


def mean_traffic(total_bytes: float, replicas: int, shards: int, owners: str) -> tuple[float, float]:
    """Mean bytes a rank sends (and receives) per step, (within its replica, across replicas), for
    matrices of ``total_bytes`` sharded evenly over ``shards`` ranks in each of ``replicas``
    replicas: owners ``"mesh"`` or ``"replica"`` (see the module docstring)."""
    m, r, s = total_bytes, replicas, shards
    if owners == "replica" or r == 1:
        return 2 * m * (s - 1) / s**2, 0.0
    n = r * s
    return m / n * 2 * (s - 1) / s, m * (r - 1) / n


def rank_traffic(
    shapes: Sequence[Shape],
    shards: int,
    rank: int,
    *,
    replicas: int = 1,
    owners: str = "replica",
    itemsize: int = 2,
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
) -> Traffic:
    """Bytes mesh rank ``rank`` sends and receives in one step of the plan ``costmodel.predict``
    prices (``Shard(0)`` over ``shards`` ranks, ``replicas`` replicas, owners ``"mesh"`` or per
    ``"replica"``): what ``plan --rehearse`` measures on that rank."""
    if replicas > 1 and owners == "mesh":
        return traffic(hsdp_plan(shapes, shards, replicas, max_round_bytes=max_round_bytes), rank, itemsize)
    return traffic(sharded_plan(shapes, shards, max_round_bytes=max_round_bytes), rank % shards, itemsize)
