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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

from ...base.weak_memo import WeakMemo
from ...numerics.newton_schulz import ns_flops
from .blocks import Block, block_numel
from .gangs import Gang, gang_cost, gang_start

__all__ = [
    "Mode",
    "OWNERS",
    "Owners",
    "DEFAULT_ROUND_BYTES",
    "MODES",
    "check_mode",
    "EVERYONE",
    "MatrixEntry",
    "Plan",
    "Round",
    "build_plan",
]

# "owner": each matrix once, on a balanced owner; "gather": every rank computes every matrix.
Mode = Literal["owner", "gather"]
MODES: tuple[str, ...] = get_args(Mode)
# Where the owners of parameters with replicas (HSDP) are: over the whole mesh, per replica, or
# "auto", priced by the cost model (``optim/policy.py``).
Owners = Literal["auto", "mesh", "replica"]
OWNERS: tuple[str, ...] = get_args(Owners)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode should be 'owner' or 'gather' but is: {mode!r}")


# Owner value meaning "every rank of the group computes this matrix" (gather mode).
EVERYONE = -1
# Full matrices (bf16) per exchange round by default: rounds bound the exchange buffers, and overlap
# one round's Newton-Schulz with the next round's all-to-all (measured: docs/benchmarks.md, bench_rounds.py).
DEFAULT_ROUND_BYTES = 4 << 20


# blocks -> replica_of -> (function, the other arguments) -> the answer, each level found by its
# object's identity (base/weak_memo.py): a model's matrices share a few layouts, one blocks tuple
# each, and hashing a blocks tuple of 8,192 ranks per matrix made an 8,192-rank plan take a second
_BY_LAYOUT: WeakMemo[WeakMemo[dict[tuple[Any, ...], tuple[int, ...]]]] = WeakMemo()


def _by_identity(
    fn: Callable[..., tuple[int, ...]], blocks: tuple[Block, ...], replica_of: Any, *rest: Any
) -> tuple[int, ...]:
    per_blocks = _BY_LAYOUT.get(blocks)
    if per_blocks is None:
        per_blocks = _BY_LAYOUT.put(blocks, WeakMemo())
    answers = per_blocks.get(replica_of)
    if answers is None:
        answers = per_blocks.put(replica_of, {})
    key = (fn, *rest)
    if key not in answers:
        answers[key] = fn(blocks, replica_of, *rest)
    return answers[key]


def _holders(
    blocks: tuple[Block, ...], replica_of: tuple[int, ...] | None, shape: tuple[int, int], replicated: bool
) -> tuple[int, ...]:
    numel = shape[0] * shape[1]
    full = tuple(r for r, b in enumerate(blocks) if block_numel(b) == numel)
    replicas = len(set(replica_of)) if replica_of is not None else 1
    if replicated or len(full) != replicas:
        return ()
    if replicas > 1 and replica_of is not None and len({replica_of[r] for r in full}) != len(full):
        return ()
    if any(block_numel(b) for r, b in enumerate(blocks) if r not in full):
        return ()
    return full


def _sharers(blocks: tuple[Block, ...], replica_of: object, replicated: bool) -> tuple[int, ...]:
    ranks = tuple(r for r, b in enumerate(blocks) if block_numel(b))
    return () if replicated or 2 * len(ranks) > len(blocks) else ranks


@dataclass(frozen=True)
class MatrixEntry:
    """One matrix to orthogonalize: its global shape and the block each group rank holds."""

    shape: tuple[int, int]
    blocks: tuple[Block, ...]
    # Every rank holds the whole matrix (replicated DTensor, DDP): the owner needs no input from
    # the others and only sends the result.
    replicated: bool = False
    # Per group rank, its replica, when the group spans replicas that hold equal blocks (HSDP with
    # owners over the whole mesh). The ranks of one replica hold every element once, so an owner
    # reads the blocks of its own replica and sends the result to every rank. None: one replica.
    replica_of: tuple[int, ...] | None = None

    def feeds(self, source: int, dest: int) -> bool:
        """Whether ``source``'s block goes to ``dest`` when ``dest`` computes this matrix."""
        return self.replica_of is None or self.replica_of[source] == self.replica_of[dest]

    @cached_property  # read per round and rank by routes and memory: O(ranks) once per entry
    def holders(self) -> tuple[int, ...]:
        """The ranks that hold this matrix whole, one per replica, while the others hold nothing
        (an expert of an expert-parallel stack), or (). Its owner is one of them."""
        return _by_identity(_holders, self.blocks, self.replica_of, self.shape, self.replicated)

    @cached_property
    def sharers(self) -> tuple[int, ...]:
        """The ranks that hold pieces of this matrix when they are at most half the group (an expert
        of an (ep, fsdp) stack, on its fsdp ranks), or (). Its owner is one of them: it then reads
        the others' pieces only, not every byte of the matrix from elsewhere."""
        return _by_identity(_sharers, self.blocks, None, self.replicated)

    @property
    def holder(self) -> int | None:
        """The one rank that holds this matrix whole while the others hold nothing (an expert of
        an expert-parallel stack), or None. Such a matrix needs no communication at all."""
        holders = self.holders
        return holders[0] if len(holders) == 1 else None


@dataclass(frozen=True)
class Round:
    """One exchange: every member's blocks go to its owner in one all-to-all and come back in one."""

    members: tuple[int, ...]  # indices into the plan's entries
    owners: tuple[int, ...]  # owner group rank per member, or EVERYONE

    def owned_by(self, rank: int) -> tuple[int, ...]:
        """The members ``rank`` computes, in member order (every member, for EVERYONE's)."""
        by_owner = self._by_owner
        if by_owner is None:
            return tuple(m for m, o in zip(self.members, self.owners) if o in (rank, EVERYONE))
        return by_owner.get(rank, ())

    @cached_property  # costmodel asks every rank of a 1,024-rank round: one pass, not one per rank
    def _by_owner(self) -> dict[int, tuple[int, ...]] | None:
        if EVERYONE in self.owners:
            return None
        out: dict[int, list[int]] = {}
        for m, o in zip(self.members, self.owners):
            out.setdefault(o, []).append(m)
        return {o: tuple(ms) for o, ms in out.items()}


@dataclass(frozen=True)
class Plan:
    group_size: int
    mode: str
    entries: tuple[MatrixEntry, ...]
    rounds: tuple[Round, ...]
    loads: tuple[int, ...]  # Newton-Schulz flops per iteration, per group rank
    gangs: tuple[Gang, ...] = ()  # split matrices: their part entries and ranks (gangs.py)

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
                    peers = sum(entry.feeds(rank, d) for d in range(self.group_size) if d != rank)
                    total += 0 if entry.replicated else peers * block_numel(blocks[rank])
                elif owner == rank:
                    total += sum(block_numel(b) for r, b in enumerate(blocks) if r != rank)
                elif not entry.replicated and entry.feeds(rank, owner):
                    total += block_numel(blocks[rank])
        return total * itemsize


def _tie_order(entries: Sequence[MatrixEntry], group_size: int) -> list[tuple[int, int]]:
    """Per rank, its place among equally loaded ranks: its rank, or with replicas (owners over the
    mesh) its place in its replica, then its replica, so that owners alternate between replicas and
    the results' traffic across them leaves from every replica's links."""
    replica_of = next((e.replica_of for e in entries if e.replica_of is not None), None)
    if replica_of is None:
        return [(r, 0) for r in range(group_size)]
    seen: dict[int, int] = {}
    order = []
    for c in replica_of:
        order.append((seen.get(c, 0), c))
        seen[c] = seen.get(c, 0) + 1
    return order


def _assign_owners(entries: Sequence[MatrixEntry], group_size: int) -> tuple[list[int], list[int]]:
    costs = [ns_flops(e.shape) for e in entries]
    owners = [0] * len(entries)
    loads = [0] * group_size
    tie = _tie_order(entries, group_size)
    held = {i: e.holders or e.sharers for i, e in enumerate(entries) if e.holders or e.sharers}
    # A matrix held whole stays on a holder: the least loaded of them (one per replica); one held
    # in pieces by a few ranks goes to the least loaded of those.
    for i in sorted(held, key=lambda i: (-costs[i], i)):
        owners[i] = min(held[i], key=lambda r: (loads[r], tie[r]))
        loads[owners[i]] += costs[i]
    order = sorted((i for i in range(len(entries)) if i not in held), key=lambda i: (-costs[i], i))
    heap = [(loads[rank], tie[rank], rank) for rank in range(group_size)]
    heapq.heapify(heap)
    for i in order:
        load, key, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], key, rank))
    for load, _, rank in heap:
        loads[rank] = load
    return owners, loads


def _assign_with_gangs(
    entries: Sequence[MatrixEntry], group_size: int, gangs: Sequence[Gang]
) -> tuple[list[int], list[int], list[Gang]]:
    """Longest processing time with gangs: a whole matrix to the least-loaded rank, a split one to
    the aligned ranks whose busiest is least loaded, all of them busy from that rank's load on
    (they iterate in lockstep). Held matrices stay on a holder, as in ``_assign_owners``."""
    owners = [0] * len(entries)
    loads = [0] * group_size
    tie = _tie_order(entries, group_size)
    parts = {i for g in gangs for i in g.parts}
    tasks: list[tuple[int, int, Gang | None]] = [
        (ns_flops(e.shape), i, None) for i, e in enumerate(entries) if i not in parts
    ]
    tasks += [(gang_cost(g.shape, len(g.parts)) * len(g.parts), g.parts[0], g) for g in gangs]
    held = {
        i: entries[i].holders or entries[i].sharers
        for _, i, g in tasks
        if g is None and (entries[i].holders or entries[i].sharers)
    }
    placed: dict[int, Gang] = {}
    for cost, i, gang in sorted(tasks, key=lambda t: (t[1] not in held, -t[0], t[1])):
        if gang is None:
            rank = min(held.get(i) or range(group_size), key=lambda r: (loads[r], tie[r]))
            owners[i] = rank
            loads[rank] += cost
            continue
        k = len(gang.parts)
        ranks = range(start := gang_start(loads, k), start + k)
        begin = max(loads[r] for r in ranks)
        for part, rank in zip(gang.parts, ranks):
            owners[part], loads[rank] = rank, begin + cost // k
        placed[i] = Gang(gang.parts, tuple(ranks), gang.shape)
    return owners, loads, [placed[g.parts[0]] for g in gangs]


def _units(entries: Sequence[MatrixEntry], gangs: Sequence[Gang]) -> list[tuple[int, ...]]:
    """What a round cannot cut: a matrix, or a split matrix's parts; in decreasing cost."""
    parts = {i for g in gangs for i in g.parts}
    units: list[tuple[tuple[int, ...], int]] = [
        ((i,), ns_flops(e.shape)) for i, e in enumerate(entries) if i not in parts
    ]
    units += [(g.parts, ns_flops(g.shape)) for g in gangs]
    return [u for u, _ in sorted(units, key=lambda u: (-u[1], u[0][0]))]


def _rounds(
    entries: Sequence[MatrixEntry], order: list[tuple[int, ...]], max_bytes: int | None, group_size: int
) -> list[list[int]]:
    """Consecutive pieces of ``order`` (units in decreasing cost) whose full matrices (2 bytes an
    element) fit ``max_bytes``, but never fewer than ``group_size`` matrices (parts): consecutive
    matrices in this order go to different owners, so every rank has work in every round."""
    if max_bytes is None:
        return [sorted(i for unit in order for i in unit)]
    rounds: list[list[int]] = [[]]
    size = 0
    for unit in order:
        nbytes = sum(2 * entries[i].shape[0] * entries[i].shape[1] for i in unit)
        if len(rounds[-1]) >= group_size and size + nbytes > max_bytes:
            rounds.append([])
            size = 0
        rounds[-1].extend(unit)
        size += nbytes
    return [sorted(r) for r in rounds]


def build_plan(
    entries: Sequence[MatrixEntry],
    group_size: int,
    mode: str = "owner",
    *,
    max_round_bytes: int | None = None,
    gangs: Sequence[Gang] = (),
) -> Plan:
    """Assign an owner to every matrix and split the matrices into exchange rounds.

    ``mode="owner"``: each matrix once, on its owner. ``mode="gather"``: every rank computes every
    matrix (the redundant strategy, kept for comparison). Rounds take matrices in decreasing cost,
    so each round mixes owners the way the whole plan does. ``gangs``: split matrices, each the
    indices of its part entries and its shape (``ranks`` empty: the plan chooses them).
    """
    check_mode(mode)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 but is: {group_size}")
    for e in entries:
        if len(e.blocks) != group_size:
            raise ValueError(f"entry has {len(e.blocks)} blocks for a group of {group_size}")
    _check_gangs(gangs, group_size, mode)
    if gangs:
        owners, loads, placed = _assign_with_gangs(entries, group_size, gangs)
    elif mode == "owner":
        owners, loads = _assign_owners(entries, group_size)
    else:
        owners = [EVERYONE] * len(entries)
        loads = [sum(ns_flops(e.shape) for e in entries)] * group_size
    rounds = tuple(
        Round(members=tuple(r), owners=tuple(owners[i] for i in r))
        for r in _rounds(entries, _units(entries, gangs), max_round_bytes, group_size)
        if r
    )
    return Plan(group_size, mode, tuple(entries), rounds, tuple(loads), tuple(placed) if gangs else ())


def _check_gangs(gangs: Sequence[Gang], group_size: int, mode: str) -> None:
    for g in gangs:
        if mode != "owner" or not 1 < len(g.parts) <= group_size:
            raise ValueError(
                f"a matrix of shape {g.shape} split over {len(g.parts)} ranks needs mode='owner' and "
                f"2 to {group_size} (the group's ranks) parts; mode is {mode!r}"
            )
