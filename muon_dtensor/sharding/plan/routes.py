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
from .build import EVERYONE, Plan, Round
from .gangs import SplitRoute, split_route
from .runs import Run, merge_members, merge_runs

__all__ = ["Inbound", "Outbound", "RoundRoute", "build_routes"]

Shape = tuple[int, ...]
# consecutive members of a stack and the block each holds alike (one copy for them all, or one each)
OwnBatch = tuple[tuple[int, ...], Block]
# (source, offset, columns, members, their rows): a source's consecutive pieces of equal width
ReceivedBatch = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]


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
    own_batches: tuple[OwnBatch, ...] = ()  # ``own``, batched


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
    own_batches: tuple[OwnBatch, ...] = ()  # ``own``, batched
    received_batches: tuple[ReceivedBatch, ...] = ()  # ``received``, batched


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
    stacks = _stacks(plan, [m for m in mine if m not in parts])
    own = tuple((m, plan.entries[m].blocks[me]) for m in incoming)
    return Inbound(
        direct=direct,
        collective=not direct and len(replicated) < len(rnd.members),
        sends=tuple(tuple(s) for s in sends),
        recv_numels=tuple(recv),
        stacks=stacks,
        copies=tuple(m for m in mine if m in replicated and not direct),
        own=own,
        received=tuple(received),
        runs=merge_members(runs, _after(stacks)),
        loose=tuple(items[i] for i in loose),
        parts=tuple((m, plan.entries[m].shape) for m in mine if m in parts),
        own_batches=_own_batches(plan, own, _after(stacks)),
    )


def _outbound(plan: Plan, rnd: Round, me: int) -> Outbound:
    mine = rnd.owned_by(me)
    parts = {i for g in plan.gangs for i in g.parts}
    after = _after(_stacks(plan, [m for m in mine if m not in parts]))
    local = plan.mode == "gather" or plan.group_size == 1 or _all_local(plan, rnd)
    own = tuple((m, plan.entries[m].blocks[me]) for m in mine)
    if local:
        empty = tuple((m, block_shape(plan.entries[m].blocks[me])) for m in rnd.members if m not in mine)
        zeros = (0,) * plan.group_size
        return Outbound(
            False, ((),) * plan.group_size, zeros, own, (), empty, own_batches=_own_batches(plan, own, after)
        )
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
    return Outbound(
        True,
        sends,
        tuple(recv),
        own,
        tuple(received),
        (),
        numels,
        merge_members(runs, after),
        rest,
        _own_batches(plan, own, after),
        _received_batches(received),
    )


def _after(stacks: Sequence[tuple[Shape, tuple[int, ...]]]) -> dict[int, int]:
    """The member after each in its stack: neighbours in one batched tensor."""
    return {ms[i]: ms[i + 1] for _, ms in stacks for i in range(len(ms) - 1)}


def _own_batches(plan: Plan, own: Sequence[tuple[int, Block]], after: dict[int, int]) -> tuple[OwnBatch, ...]:
    """``own`` as runs of stack neighbours whose block is the same full-width row range."""
    out: list[tuple[list[int], Block]] = []
    for m, block in own:
        last = out[-1] if out else None
        whole_rows = len(block[0]) == 1 and block[1] == ((0, plan.entries[m].shape[-1]),)
        if last is not None and whole_rows and after.get(last[0][-1]) == m and last[1] == block:
            last[0].append(m)
        else:
            out.append(([m], block))
    return tuple((tuple(ms), block) for ms, block in out)


def _received_batches(received: Sequence[tuple[int, int, int, Shape]]) -> tuple[ReceivedBatch, ...]:
    """A source's consecutive pieces of the same width, back to back in its segment."""
    out: list[tuple[int, int, int, list[int], list[int]]] = []
    for m, src, offset, shape in received:
        last = out[-1] if out else None
        if (
            last is not None
            and (last[0], last[2]) == (src, shape[1])
            and offset == last[1] + sum(last[4]) * shape[1]
        ):
            last[3].append(m)
            last[4].append(shape[0])
        else:
            out.append((src, offset, shape[1], [m], [shape[0]]))
    return tuple((src, off, cols, tuple(ms), tuple(rows)) for src, off, cols, ms, rows in out)


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


def _by_shape(plan: Plan, rnd: Round) -> Round:
    """The round's members ordered by shape (then index), the same on every rank: a stack's members
    travel back to back in every segment, so their copies merge (``merge_members``)."""
    order = sorted(
        range(len(rnd.members)), key=lambda i: (plan.entries[rnd.members[i]].shape, rnd.members[i])
    )
    return Round(tuple(rnd.members[i] for i in order), tuple(rnd.owners[i] for i in order))


def build_routes(plan: Plan, me: int) -> tuple[RoundRoute, ...]:
    """Group rank ``me``'s route through every round of ``plan``: pure, built once with the plan."""
    rounds = [_by_shape(plan, r) for r in plan.rounds]
    return tuple(
        RoundRoute(
            r.members, _inbound(plan, r, me), _outbound(plan, r, me), split_route(plan.gangs, r.members, me)
        )
        for r in rounds
    )
