"""The transient bytes of one Muon step on one rank, from its plan: pure arithmetic, no tensors.

What a step allocates beyond the optimizer's state (functional.muon_step, exchange.run_plan), per
exchange group, in the order run_plan allocates and frees it:

- the Newton-Schulz input of every local piece (alive all step), plus the momentum's bucket
  temporaries while it is computed;
- per round: the send and receive buffers to the owners (freed once the next round's are started),
  the full matrices this rank owns (freed when the next round's are assembled), their results, the
  Newton-Schulz workspace of one matrix (CPU) or one same-shape batch (CUDA), and the send and
  receive buffers back (freed with the results once the round is placed);
- at most two rounds' buffers at once, as the pipeline keeps them.

``round_sizes`` reads one rank's figures from the plan; ``exchange_peak`` replays run_plan's order
over them. The planning CLI and ``Muon.memory`` both use these, so the two print the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...base.weak_memo import WeakMemo
from ...numerics.blockwise import CHUNK_ELEMENTS
from .blocks import block_numels
from .build import EVERYONE, MatrixEntry, Plan

__all__ = [
    "RoundSizes",
    "bucket_sizes",
    "exchange_peak",
    "group_peak",
    "int8_chunk",
    "ns_workspace",
    "overlapped",
    "round_sizes",
]

Shape = tuple[int, int]
# int8 momentum's float32 copies of a chunk alive at once (blockwise.int8_momentum): the scaled
# gradient, the working momentum and the two of the next op's inputs and result.
INT8_COPIES = 4


def int8_chunk(numels: Sequence[int], chunk: int = CHUNK_ELEMENTS) -> int:
    """The elements of int8 momentum's largest stacked chunk (``blockwise._chunks``): tensors of one
    size (standing in for one shape), as many as fit in ``chunk`` (``blockwise.chunk_elements`` of
    the device), one at least."""
    counts: dict[int, int] = {}
    for n in numels:
        if n:
            counts[n] = counts.get(n, 0) + 1
    return max((n * min(k, max(1, chunk // n)) for n, k in counts.items()), default=0)


@dataclass(frozen=True)
class RoundSizes:
    """One rank's elements in one round: sent and received on the way to the owners, full matrices
    it assembles, the shapes of the results it computes (in compute order), sent and received on the
    way back, and its piece of each member's result (in member order)."""

    send_in: int
    recv_in: int
    full: int
    results: tuple[tuple[Shape, int], ...]
    send_out: int
    recv_out: int
    pieces: tuple[int, ...]


def _all_local(plan: Plan, members: Sequence[int], owners: Sequence[int]) -> bool:
    return plan.mode == "owner" and all(plan.entries[m].holder == o for m, o in zip(members, owners))


def round_sizes(plan: Plan, me: int) -> tuple[RoundSizes, ...]:
    """Group rank ``me``'s figures per round of ``plan`` (the routes' buffer sizes, routes.py)."""
    numels = _numels(plan)
    out = []
    for rnd in plan.rounds:
        direct = plan.group_size == 1 or _all_local(plan, rnd.members, rnd.owners)
        back = not direct and plan.mode != "gather"
        send_in = recv_in = full = send_out = recv_out = 0
        shapes: dict[Shape, int] = {}
        for m, owner in zip(rnd.members, rnd.owners):
            e = plan.entries[m]
            mine = numels[m][me]
            ranks = range(plan.group_size)
            if owner in (me, EVERYONE):
                shapes[e.shape] = shapes.get(e.shape, 0) + 1
                if not direct:
                    full += e.shape[0] * e.shape[1]
                    if not e.replicated:
                        recv_in += _others(numels[m], me, e)
                if back and owner == me:
                    send_out += sum(numels[m]) - numels[m][me]
            if owner != me and not direct and not e.replicated:
                dests = ranks if owner == EVERYONE else (owner,)
                send_in += mine * sum(1 for d in dests if d != me and e.feeds(me, d))
            if back and owner != me:
                recv_out += mine
        pieces = tuple(numels[m][me] for m in rnd.members)
        out.append(RoundSizes(send_in, recv_in, full, tuple(shapes.items()), send_out, recv_out, pieces))
    return tuple(out)


_NUMELS: WeakMemo[list[tuple[int, ...]]] = WeakMemo(limit=16)  # per plan, held weakly


def _numels(plan: Plan) -> list[tuple[int, ...]]:
    """Per entry, every group rank's block elements; computed once per plan (and per distinct
    blocks tuple), since ``round_sizes`` is asked for every rank of a plan in turn."""
    cached = _NUMELS.get(plan)
    if cached is not None:
        return cached
    return _NUMELS.put(plan, [block_numels(e.blocks) for e in plan.entries])


def _others(numels: tuple[int, ...], me: int, entry: MatrixEntry) -> int:
    """Elements of the other ranks' blocks that feed ``me`` (all of them with one replica)."""
    if entry.replica_of is None:
        return sum(numels) - numels[me]
    return sum(n for s, n in enumerate(numels) if s != me and entry.feeds(s, me))


def ns_workspace(shape: Shape, count: int, *, batched: bool, gram: bool = False) -> int:
    """Elements newton_schulz holds beyond its results while it runs ``count`` matrices of
    ``shape``: the normalized iterate and the two small Gram-side matrices of an iteration (three
    more in the Gram form), per matrix; a CUDA batch also stacks its inputs."""
    m, n = shape
    small = min(m, n) ** 2
    per = m * n + (5 if gram else 2) * small
    return count * (per + m * n) if batched and count > 1 else per


def bucket_sizes(numels: Sequence[int], *, cpu: bool, cpu_piece: int = 1 << 17) -> list[int]:
    """Elements per bucket of ``elementwise.buckets`` over contiguous tensors of ``numels``
    elements: on CPU cut into ``cpu_piece``-element pieces (2**17; 2**18 for a momentum buffer of
    another dtype), buckets of at most that (CUDA: 2**26, a larger tensor alone)."""
    limit = cpu_piece if cpu else 1 << 26
    sizes, size = [], 0
    for n in numels:
        for part in [min(limit, n - a) for a in range(0, n, limit)] if cpu and n > limit else [n]:
            if size and size + part > limit:
                sizes.append(size)
                size = 0
            size += part
    return sizes + [size] if size else sizes


def overlapped(sizes: Sequence[int]) -> int:
    """The most of ``sizes`` alive at once when each bucket's temporaries are made before the
    previous bucket's are dropped (a loop that rebinds them)."""
    return max([a + b for a, b in zip(sizes, sizes[1:])] + list(sizes) + [0])


def exchange_peak(
    rounds: Sequence[RoundSizes],
    *,
    itemsize: int,
    batched: bool,
    finalize: Sequence[int] = (),
    gram: bool = False,
) -> int:
    """Peak bytes one ``run_plan`` holds at once over ``rounds``, in run_plan's order (round k+1's
    inbound buffers start before round k is computed; round k-1 is placed after round k's results
    leave). ``finalize[k]``: bytes of round k's placing temporaries (0 when not given)."""
    live = peak = 0

    def grow(nbytes: int) -> None:
        nonlocal live, peak
        live += nbytes
        peak = max(peak, live)

    if not rounds:
        return 0
    inbound = [(r.send_in + r.recv_in) * itemsize for r in rounds]
    grow(inbound[0])
    stacks, pending = 0, []
    for k, r in enumerate(rounds):
        grow(r.full * itemsize)
        live -= stacks
        stacks = r.full * itemsize
        if k + 1 < len(rounds):
            grow(inbound[k + 1])
            live -= inbound[k]
        results = 0
        for shape, count in r.results:
            per = math.prod(shape) * itemsize
            # one at a time (CPU): the last matrix's workspace over the others' results
            work = ns_workspace(shape, count if batched else 1, batched=batched, gram=gram)
            peak = max(peak, live + count * per + work * itemsize)
            grow(count * per)
            results += count * per
        out = (r.send_out + r.recv_out) * itemsize
        grow(out)
        pending.append((k, out + results))
        if len(pending) > 1:
            done, held = pending.pop(0)
            peak = max(peak, live + (finalize[done] if finalize else 0))
            live -= held
    for done, held in pending:
        peak = max(peak, live + (finalize[done] if finalize else 0))
        live -= held
    return peak


def group_peak(
    numels: Sequence[int],
    assembled: Sequence[bool],
    domains: Sequence[tuple[Plan, int, Sequence[int]]],
    *,
    param_item: int,
    ns_item: int,
    nesterov: bool,
    cpu: bool,
    normuon: bool = False,
    gram: bool = False,
    momentum_item: int = 0,
    chunk: int = CHUNK_ELEMENTS,
) -> int:
    """Peak transient bytes of one Muon group's step on one rank. ``numels``: local elements per
    parameter; ``assembled``: whether its update is assembled from several matrices (functional's
    update buffers); ``domains``: per exchange group its plan, this rank's group rank and the
    parameter position of each plan entry. NorMuon's inputs are counted twice (the second moment
    is concatenated in front of a copy); its owner-side row pass is not modelled. ``momentum_item``:
    the itemsize of a momentum buffer kept in another dtype than the parameter's (0: the same);
    ``chunk``: int8 momentum's chunk elements on the rank's device (``blockwise.chunk_elements``)."""
    ns_in = sum(numels) * ns_item * (2 if normuon else 1)
    # muon_momentum: the scaled gradient (and the Nesterov source) of one bucket at a time; a buffer
    # of another dtype adds its wide working copy (and the gradient's, if the gradient is narrower)
    per = param_item * (2 if nesterov else 1)
    if momentum_item:
        wide = max(param_item, momentum_item)
        per = wide * (2 + int(nesterov) + int(param_item < wide))
    temps = max(bucket_sizes(numels, cpu=cpu, cpu_piece=(1 << 18) if momentum_item else 1 << 17) or [0]) * per
    if momentum_item == 1:  # int8 blocks (blockwise.int8_momentum): float32 copies of one chunk
        temps = int8_chunk(numels, chunk) * (4 * INT8_COPIES + 1 + int(nesterov))
    updates = sum(n for n, a in zip(numels, assembled) if a) * param_item
    exchange = 0
    for plan, me, positions in domains:
        sizes = round_sizes(plan, me)
        finalize = []
        for rnd, r in zip(plan.rounds, sizes):  # apply_results' buckets, then the placed pieces
            pos = [positions[m] for m in rnd.members]
            now = overlapped(bucket_sizes([n for n, p in zip(r.pieces, pos) if not assembled[p]], cpu=cpu))
            placed = sum(n for n, p in zip(r.pieces, pos) if assembled[p])
            finalize.append(max(now, placed) * param_item)
        peak = exchange_peak(sizes, itemsize=ns_item, batched=not cpu, finalize=finalize, gram=gram)
        exchange = max(exchange, peak)
    return max(ns_in + temps, ns_in + updates + exchange)
