"""Copies between a matrix and an exchange buffer, merged into strided runs: plain data, pure functions.

An owner assembles each matrix from one block per source and packs its result back as one block
per destination; one copy per block is 2 (n - 1) eager ops per owned matrix on n ranks, which is
most of the host's time per step from a few hundred ranks on (docs/benchmarks.md, section 8). When
consecutive blocks are full-width row ranges of equal height, one after another in the matrix,
and lie at a fixed stride in the flat buffer (even ``Shard`` placements: every source sends the
same members in the same order), one strided copy moves them all. The bytes moved and their
places are the same, so the step is unchanged bit for bit; other blocks stay one copy each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .blocks import Block, block_numel

__all__ = ["Run", "merge_runs", "owner_copies"]

Item = tuple[int, int, Block]  # (member, flat offset in the buffer, its block of the matrix)


@dataclass(frozen=True)
class Run:
    """``count`` blocks of member ``member``, each ``rows`` full-width rows from row ``row`` on,
    back to back in the matrix and ``stride`` elements apart in the buffer from ``offset``."""

    member: int
    row: int
    rows: int
    count: int
    offset: int
    stride: int


def _row_range(block: Block, cols: int) -> tuple[int, int] | None:
    """(first row, rows) of a non-empty block that is one full-width row range, else None."""
    if len(block) != 2 or len(block[0]) != 1 or block[1] != ((0, cols),) or not block_numel(block):
        return None
    start, stop = block[0][0]
    return start, stop - start


def _extends(run: Run, start: int, rows: int, offset: int) -> bool:
    if rows != run.rows or start != run.row + run.count * run.rows:
        return False
    return run.count == 1 and offset > run.offset or offset == run.offset + run.count * run.stride


def merge_runs(items: Sequence[Item], cols: Mapping[int, int]) -> tuple[tuple[Run, ...], tuple[int, ...]]:
    """The runs that cover ``items`` (in buffer order; ``cols``: each member's column count) and
    the indices of the items no run can take (several rectangles, partial width); empty blocks
    are in neither."""
    done: list[Run] = []
    loose: list[int] = []
    open_runs: dict[int, Run] = {}
    for i, (member, offset, block) in enumerate(items):
        found = _row_range(block, cols[member])
        if found is None:
            if block_numel(block):  # an empty block needs no copy at all
                loose.append(i)
            continue
        start, rows = found
        run = open_runs.get(member)
        if run is not None and _extends(run, start, rows, offset):
            stride = offset - run.offset if run.count == 1 else run.stride
            open_runs[member] = Run(member, run.row, rows, run.count + 1, run.offset, stride)
            continue
        if run is not None:
            done.append(run)
        open_runs[member] = Run(member, start, rows, 1, offset, rows * cols[member])
    return tuple(done) + tuple(open_runs.values()), tuple(loose)


def owner_copies(blocks: Sequence[Block], cols: int, replicas: int = 1) -> int:
    """At most how many copies (eager ops) an owner makes for one matrix of ``blocks`` (one per
    group rank, replicas in turn): assemble it from its replica's other ranks, pack it back to every
    other rank, and its own block. The runs ``merge_runs`` finds where the round's other matrices
    share the layout (the owner's own block splits one run each way); the cost model's host ops."""
    n = len(blocks)
    blockwise = n // replicas + n - 1
    runs_in, runs_out = _segments(blocks[: n // replicas], cols), _segments(blocks, cols)
    if runs_in is None or runs_out is None:
        return blockwise
    return min(runs_in + runs_out + 3, blockwise)


def _segments(blocks: Sequence[Block], cols: int) -> int | None:
    """Runs covering the non-empty ``blocks`` in order, if each is one full-width row range."""
    count, last = 0, (-1, -1)
    for block in blocks:
        found = _row_range(block, cols)
        if found is None:
            if block_numel(block):
                return None
            continue
        if found[1] != last[1] or found[0] != last[0] + last[1]:
            count += 1
        last = found
    return count
