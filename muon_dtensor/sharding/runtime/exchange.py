"""Run a plan along this rank's routes: blocks to their owners, Newton-Schulz once per matrix, results
back to every block.

For each round, on group rank ``me`` (the routes say what goes where, routes.build_routes):
  1. ``prepare`` my block of every matrix; send each to its owner (gather mode: to every rank): one
     all-to-all;
  2. assemble each matrix I own from the blocks, stacked by shape;
  3. ``compute`` (orthogonalize) my same-shape matrices together;
  4. send every rank its block of each result: one all-to-all; ``finalize`` my blocks.
This is the prepare / compute / finalize shape of torchtitan's ``runtime.run``. A rank's own blocks of
the matrices it owns never enter a collective: they are read from (and sliced into) local tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...base.torch_ops import foreach_copy_
from ...numerics.newton_schulz import stacked
from ..plan.blocks import Block, block_numel, block_shape
from ..plan.gangs import SplitRoute
from ..plan.routes import Inbound, Outbound, OwnBatch, RoundRoute
from ..plan.runs import Run
from .comm import CommStats, pack_chunks, start_exchange

__all__ = ["Compute", "Finalize", "Prepare", "SplitCompute", "pack_results", "run_plan", "unpack_received"]

Prepare = Callable[[int], Tensor]  # member -> my block of it, in the Newton-Schulz dtype
Compute = Callable[[Sequence[Tensor]], Sequence[Tensor]]  # same-shape full matrices -> results
Finalize = Callable[[Sequence[int], Sequence[Tensor]], None]  # members, my block of each result
Stacks = list[tuple[tuple[int, ...], list[Tensor]]]  # (members, their full matrices) by shape
SplitCompute = Callable[[SplitRoute, dict[int, Tensor]], dict[int, Tensor]]  # parts -> results
Assembled = tuple[Stacks, dict[int, Tensor]]  # whole matrices by shape, split matrices' parts


def _rects(block: Block) -> Iterator[tuple[slice, slice, slice, slice]]:
    """(global rows, global cols, local rows, local cols) of each rectangle of a 2-D block."""
    local_r = 0
    for r0, r1 in block[0]:
        local_c = 0
        for c0, c1 in block[1]:
            yield (
                slice(r0, r1),
                slice(c0, c1),
                slice(local_r, local_r + r1 - r0),
                slice(local_c, local_c + c1 - c0),
            )
            local_c += c1 - c0
        local_r += r1 - r0


def _assemble(full: Tensor, block: Block, piece: Tensor) -> None:
    """Write a block (any shape holding its elements in block order) into the full matrix."""
    rows, cols = block
    if (
        len(rows) == 1
        and cols == ((0, full.shape[-1]),)
        and piece.shape == (rows[0][1] - rows[0][0], cols[0][1])
    ):
        full[rows[0][0] : rows[0][1]].copy_(piece)  # full-width rows, already 2-D: one slice, one copy
        return
    local = piece.reshape(block_shape(block))
    for gr, gc, lr, lc in _rects(block):
        full[gr, gc] = local[lr, lc]


def _cut(full: Tensor, block: Block) -> Tensor:
    """A block of a full matrix: a view when it is one rectangle, else a copy in block order."""
    rows, cols = block
    if len(rows) == 1 and cols == ((0, full.shape[-1]),):  # full-width rows: one slice, one op
        return full[rows[0][0] : rows[0][1]]
    rects = list(_rects(block))
    if len(rects) == 1:
        return full[rects[0][0], rects[0][1]]
    local = full.new_empty(block_shape(block))
    for gr, gc, lr, lc in rects:
        local[lr, lc] = full[gr, gc]
    return local


def _run_views(buffer: Tensor, matrix: Tensor, run: Run) -> tuple[Tensor, Tensor]:
    """A run's blocks as views of the flat buffer and of the matrix: (count, rows, cols), or with
    several members (members, count, rows, cols), the matrix then the first of a contiguous stack."""
    cols = matrix.shape[-1]
    size, stride = (run.count, run.rows, cols), (run.stride, cols, 1)
    rows_at = matrix.storage_offset() + run.row * cols
    if run.more:
        batch = (len(run.members), *size)
        flat = buffer.as_strided(batch, (run.step, *stride), buffer.storage_offset() + run.offset)
        return flat, matrix.as_strided(batch, (matrix.numel(), run.rows * cols, cols, 1), rows_at)
    flat = buffer.as_strided(size, stride, buffer.storage_offset() + run.offset)
    if matrix.is_contiguous():  # assembled here, or a result: its run of rows is one strided view
        rows = matrix.as_strided(size, (run.rows * cols, cols, 1), rows_at)
    else:
        rows = matrix[run.row : run.row + run.count * run.rows].unflatten(0, (run.count, run.rows))
    return flat, rows


def _batch_view(matrix: Tensor, count: int, block: Block) -> Tensor:
    """(count, rows, cols) view of the same full-width row block of ``count`` stacked matrices."""
    (r0, r1), cols = block[0][0], matrix.shape[-1]
    return matrix.as_strided(
        (count, r1 - r0, cols), (matrix.numel(), cols, 1), matrix.storage_offset() + r0 * cols
    )


def _own_in(batches: Sequence[OwnBatch], where: dict[int, Tensor], local: dict[int, Tensor]) -> None:
    """My own blocks of the matrices I assemble, from my local pieces: one multi-tensor copy per
    batch of stack neighbours, else a copy each."""
    for members, block in batches:
        pieces = [local[m] for m in members]
        shape = block_shape(block)
        if len(members) > 1 and all(p.shape == shape for p in pieces):
            foreach_copy_(list(_batch_view(where[members[0]], len(members), block).unbind(0)), pieces)
            continue
        for m, piece in zip(members, pieces):
            _assemble(where[m], block, piece)


def _own_out(batches: Sequence[OwnBatch], results: dict[int, Tensor]) -> dict[int, Tensor]:
    """My blocks of the results I computed: one view per batch of stacked results, else one each."""
    out: dict[int, Tensor] = {}
    for members, block in batches:
        if len(members) > 1 and stacked([results[m] for m in members]):
            out.update(zip(members, _batch_view(results[members[0]], len(members), block).unbind(0)))
            continue
        out.update({m: _cut(results[m], block) for m in members})
    return out


def unpack_received(route: Inbound, received: Tensor, where: dict[int, Tensor]) -> None:
    """Step 2's copies: the received buffer into the full matrices ``where``, run by run (a run is
    several sources' rows in one copy), then the blocks no run covers."""
    for run in route.runs:
        pieces, rows = _run_views(received, where[run.member], run)
        rows.copy_(pieces)
    for m, offset, block in route.loose:
        _assemble(where[m], block, received[offset : offset + block_numel(block)])


def pack_results(route: Outbound, results: dict[int, Tensor], send: Tensor) -> Tensor:
    """Step 4's copies: an owner's results into ``send`` (returned), run by run (a stack's members in
    one copy where their results are one tensor), then the loose blocks."""
    for run in route.send_runs:
        together = not run.more or stacked([results[m] for m in run.members])
        for part in [run] if together else [run.single(j) for j in range(len(run.members))]:
            pieces, rows = _run_views(send, results[part.member], part)
            pieces.copy_(rows)
    for m, offset, block in route.send_loose:
        piece = _cut(results[m], block)
        send[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
    return send


def _to_owners(
    route: Inbound, local: dict[int, Tensor], group: dist.ProcessGroup | None, stats: CommStats | None
) -> Callable[[], Assembled]:
    """Steps 1-2: start moving blocks to owners; the returned function waits and assembles."""
    if route.direct:
        return lambda: (
            [(ms, [local[m] for m in ms]) for _, ms in route.stacks],
            {m: local[m] for m, _ in route.parts},
        )
    sample = next(iter(local.values()))
    receive: Callable[[], Tensor] = lambda: sample.new_empty(0)  # noqa: E731
    if route.collective:
        assert group is not None
        chunks = [[local[m] for m in members] for members in route.sends]
        send, numels = pack_chunks(chunks, dtype=sample.dtype, device=sample.device)
        receive = start_exchange(send, numels, route.recv_numels, group=group, stats=stats)

    def finish() -> Assembled:
        received = receive()
        stacks = [(ms, list(sample.new_empty((len(ms), *shape)).unbind(0))) for shape, ms in route.stacks]
        parts = {m: sample.new_empty(shape) for m, shape in route.parts}
        where = {m: full for ms, fulls in stacks for m, full in zip(ms, fulls)} | parts
        for m in route.copies:
            where[m].copy_(local[m])
        _own_in(route.own_batches, where, local)
        unpack_received(route, received, where)
        if stats is not None:
            stats.release(sum(route.recv_numels) * sample.element_size())
        return stacks, parts

    return finish


def _to_blocks(
    route: Outbound,
    results: dict[int, Tensor],
    ref: Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
) -> Callable[[], dict[int, Tensor]]:
    """Step 4: start sending results back; the returned function waits and returns my blocks."""
    if not route.collective:
        out = {m: ref.new_empty(shape) for m, shape in route.empty}
        out.update(_own_out(route.own_batches, results))
        return lambda: out
    assert group is not None
    send = pack_results(
        route, results, torch.empty(sum(route.send_numels), dtype=ref.dtype, device=ref.device)
    )
    receive = start_exchange(send, route.send_numels, route.recv_numels, group=group, stats=stats)

    def finish() -> dict[int, Tensor]:
        returned = receive().split(list(route.recv_numels))
        out = _own_out(route.own_batches, results)
        for src, offset, cols, members, rows in route.received_batches:
            if len(members) == 1:
                out[members[0]] = returned[src][offset : offset + rows[0] * cols].view(rows[0], cols)
                continue
            segment = returned[src][offset : offset + sum(rows) * cols]
            out.update(zip(members, segment.view(sum(rows), cols).split(list(rows))))
        if stats is not None:
            stats.release(sum(route.recv_numels) * ref.element_size())
        return out

    return finish


def run_plan(
    routes: Sequence[RoundRoute],
    *,
    prepare: Prepare,
    compute: Compute,
    finalize: Finalize,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
    split: SplitCompute | None = None,
) -> None:
    """Orthogonalize every matrix of a plan along this rank's ``routes``; ``split`` runs the split
    matrices' parts of a round (``split_compute``), on every rank of a round that has any.

    Rounds are pipelined: round k+1's blocks travel while round k is orthogonalized, and round k's
    results travel back while round k+1 is; so at most two rounds' buffers are alive at once. Every
    rank issues the collectives in the same order (in 0, in 1, out 0, in 2, out 1, ...).
    """
    if not routes:
        return
    blocks = [{m: prepare(m) for m in routes[0].members}]
    inbound = _to_owners(routes[0].inbound, blocks[0], group, stats)
    outbound: list[tuple[RoundRoute, Callable[[], dict[int, Tensor]]]] = []
    for k, route in enumerate(routes):
        stacks, parts = inbound()
        if k + 1 < len(routes):
            blocks.append({m: prepare(m) for m in routes[k + 1].members})
            inbound = _to_owners(routes[k + 1].inbound, blocks[k + 1], group, stats)
        results = _compute(stacks, compute, stats)
        if route.split is not None:
            assert split is not None, "a plan with split matrices needs their compute"
            results.update(split(route.split, parts))
        ref = blocks[k][route.members[0]]
        outbound.append((route, _to_blocks(route.outbound, results, ref, group, stats)))
        if len(outbound) > 1:
            _finish(*outbound.pop(0), finalize)
    for done, finish in outbound:
        _finish(done, finish, finalize)


def _compute(stacks: Stacks, compute: Compute, stats: CommStats | None) -> dict[int, Tensor]:
    results: dict[int, Tensor] = {}
    for members, fulls in stacks:
        results.update(zip(members, compute(fulls)))
        if stats is not None:
            stats.orthogonalized += len(members)
    return results


def _finish(route: RoundRoute, finish: Callable[[], dict[int, Tensor]], finalize: Finalize) -> None:
    mine = finish()
    finalize(route.members, [mine[m] for m in route.members])
