"""What one rank sends, receives and assembles in each round of a plan: plain frozen data.

Derived once from the plan and the rank (``build_routes``), so the exchange (``exchange.py``) only
moves data along it. Members are indices into the plan's entries. Copies between a matrix and an
exchange buffer are merged into strided runs where the blocks allow (``runs.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import Block, block_numel, block_shape
from .gangs import SplitRoute, split_route
from .plan import EVERYONE, Plan, Round
from .runs import Run, merge_runs

__all__ = ["Inbound", "Outbound", "RoundRoute", "build_routes"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Inbound:
    """Blocks to owners. ``stacks``: (shape, members) this rank computes, batched by shape;
    ``parts``: (member, shape) of the split matrices' parts it computes (``split``)."""

    direct: bool  # group of one, or every matrix whole on its owner: the local blocks are the matrices
    collective: bool  # an all-to-all runs (not when direct, nor when every member is replicated)
    sends: tuple[tuple[int, ...], ...]  # per group rank: members whose local block goes there
    recv_numels: tuple[int, ...]
    stacks: tuple[tuple[Shape, tuple[int, ...]], ...]
    copies: tuple[int, ...]  # replicated members I compute: copy my whole local block
    own: tuple[tuple[int, Block], ...]  # my own block of members I compute, from local
    received: tuple[tuple[int, int, int, Block], ...]  # (member, source, offset, block)
    runs: tuple[Run, ...]  # ``received`` as strided copies from the flat receive buffer
    loose: tuple[tuple[int, int, Block], ...]  # (member, flat offset, block) copied one by one
    parts: tuple[tuple[int, Shape], ...] = ()


@dataclass(frozen=True)
class Outbound:
    """Results back to every block. Without a collective, ``empty`` lists the members I hold no
    result of (only an empty block), with their block shapes."""

    collective: bool
    sends: tuple[tuple[tuple[int, Block], ...], ...]  # per group rank: (member, its block) to cut
    recv_numels: tuple[int, ...]
    own: tuple[tuple[int, Block], ...]  # my block of the results I computed, sliced locally
    received: tuple[tuple[int, int, int, Shape], ...]  # (member, source, offset, block shape)
    empty: tuple[tuple[int, Shape], ...]
    send_numels: tuple[int, ...] = ()  # per group rank: elements of ``sends`` to it
    send_runs: tuple[Run, ...] = ()  # ``sends`` as strided copies into the flat send buffer
    send_loose: tuple[tuple[int, int, Block], ...] = ()  # (member, flat offset, block) copied one by one


@dataclass(frozen=True)
class RoundRoute:
    members: tuple[int, ...]
    inbound: Inbound
    outbound: Outbound
    split: SplitRoute | None = None  # the round's split matrices (every rank joins their collectives)


def _all_local(plan: Plan, rnd: Round) -> bool:
    """Every matrix of the round sits whole on its owner (expert parallel): no collective at all."""
    return plan.mode == "owner" and all(plan.entries[m].holder == o for m, o in zip(rnd.members, rnd.owners))


def _stacks(plan: Plan, members: Sequence[int]) -> tuple[tuple[Shape, tuple[int, ...]], ...]:
    groups: dict[Shape, list[int]] = {}
    for m in members:
        groups.setdefault(plan.entries[m].shape, []).append(m)
    return tuple((shape, tuple(ms)) for shape, ms in groups.items())


def _received(plan: Plan, me: int, by_source: Sequence[Sequence[int]], of: int | None) -> list[tuple]:
    """(member, source, offset, block) of what each source sends here, packed in member order;
    ``of`` names whose block (None: the source's own) each member's piece is."""
    out = []
    for src, members in enumerate(by_source):
        offset = 0
        for m in members if src != me else ():
            block = plan.entries[m].blocks[src if of is None else of]
            out.append((m, src, offset, block))
            offset += block_numel(block)
    return out


def _inbound(plan: Plan, rnd: Round, me: int) -> Inbound:
    mine = rnd.owned_by(me)
    parts = {i for g in plan.gangs for i in g.parts}
    direct = plan.group_size == 1 or _all_local(plan, rnd)
    replicated = {m for m in rnd.members if plan.entries[m].replicated}
    sends: list[list[int]] = [[] for _ in range(plan.group_size)]
    for member, owner in zip(rnd.members, rnd.owners):
        dests = range(plan.group_size) if owner == EVERYONE else (owner,)
        for dest in dests if not direct and member not in replicated else ():
            # my own blocks never enter the collective (one copy less each way); with replicas,
            # an owner reads only its own replica's blocks
            if dest != me and plan.entries[member].feeds(me, dest):
                sends[dest].append(member)
    incoming = [m for m in mine if m not in replicated and not direct]
    by_source = [[m for m in incoming if plan.entries[m].feeds(src, me)] for src in range(plan.group_size)]
    received = _received(plan, me, by_source, None)
    recv = [0] * plan.group_size
    for _, src, _, block in received:
        recv[src] += block_numel(block)
    starts = _starts(recv)
    items = [(m, starts[src] + off, b) for m, src, off, b in received]
    runs, loose = merge_runs(items, _cols(plan, rnd.members))
    return Inbound(
        direct=direct,
        collective=not direct and len(replicated) < len(rnd.members),
        sends=tuple(tuple(s) for s in sends),
        recv_numels=tuple(recv),
        stacks=_stacks(plan, [m for m in mine if m not in parts]),
        copies=tuple(m for m in mine if m in replicated and not direct),
        own=tuple((m, plan.entries[m].blocks[me]) for m in incoming),
        received=tuple(received),
        runs=runs,
        loose=tuple(items[i] for i in loose),
        parts=tuple((m, plan.entries[m].shape) for m in mine if m in parts),
    )


def _outbound(plan: Plan, rnd: Round, me: int) -> Outbound:
    mine = rnd.owned_by(me)
    local = plan.mode == "gather" or plan.group_size == 1 or _all_local(plan, rnd)
    own = tuple((m, plan.entries[m].blocks[me]) for m in mine)
    if local:
        empty = tuple((m, block_shape(plan.entries[m].blocks[me])) for m in rnd.members if m not in mine)
        zeros = (0,) * plan.group_size
        return Outbound(False, ((),) * plan.group_size, zeros, own, (), empty)
    sends = tuple(
        () if d == me else tuple((m, plan.entries[m].blocks[d]) for m in mine) for d in range(plan.group_size)
    )
    by_source = [rnd.owned_by(src) for src in range(plan.group_size)]
    received = [(m, src, off, block_shape(b)) for m, src, off, b in _received(plan, me, by_source, me)]
    recv = [0] * plan.group_size
    for _, src, _, shape in received:
        recv[src] += math.prod(shape)
    numels = tuple(sum(block_numel(b) for _, b in per_dest) for per_dest in sends)
    items = [item for per_dest, start in zip(sends, _starts(numels)) for item in _laid(per_dest, start)]
    runs, loose = merge_runs(items, _cols(plan, rnd.members))
    rest = tuple(items[i] for i in loose)
    return Outbound(True, sends, tuple(recv), own, tuple(received), (), numels, runs, rest)


def _starts(numels: Sequence[int]) -> list[int]:
    """Where each rank's segment begins in a flat buffer of segments in rank order."""
    starts, total = [], 0
    for n in numels:
        starts.append(total)
        total += n
    return starts


def _laid(per_dest: Sequence[tuple[int, Block]], start: int) -> list[tuple[int, int, Block]]:
    """(member, flat offset, block) of one destination's blocks, packed from ``start``."""
    out = []
    for m, block in per_dest:
        out.append((m, start, block))
        start += block_numel(block)
    return out


def _cols(plan: Plan, members: Sequence[int]) -> dict[int, int]:
    """Columns of each of a round's matrices (``merge_runs`` needs no others)."""
    return {m: plan.entries[m].shape[-1] for m in members}


def build_routes(plan: Plan, me: int) -> tuple[RoundRoute, ...]:
    """Group rank ``me``'s route through every round of ``plan``: pure, built once with the plan."""
    return tuple(
        RoundRoute(
            r.members, _inbound(plan, r, me), _outbound(plan, r, me), split_route(plan.gangs, r.members, me)
        )
        for r in plan.rounds
    )
