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
from dataclasses import dataclass, replace

from .blocks import Block, block_numel

__all__ = ["Run", "merge_members", "merge_runs", "owner_copies", "segments"]

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
    more: tuple[int, ...] = ()  # members after ``member`` in its stack, each's blocks ``step`` further on
    step: int = 0

    @property
    def members(self) -> tuple[int, ...]:
        return (self.member, *self.more)

    def single(self, j: int) -> Run:
        """The part of this run that is its ``j``-th member's: a run of one member."""
        return Run(self.members[j], self.row, self.rows, self.count, self.offset + j * self.step, self.stride)


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


def merge_members(runs: Sequence[Run], after: Mapping[int, int]) -> tuple[Run, ...]:
    """``runs`` with runs of consecutive members of a stack (``after[m]``: the member after ``m`` in
    its stack) merged where they have the same rows, count and stride and their blocks lie a fixed
    step apart in the buffer (every source sends a stack's members in order): one copy per stack
    and run of sources, not per matrix."""
    out: list[Run] = []
    for run in sorted(runs, key=lambda r: r.offset):
        if out and _joins(out[-1], run, after):
            last = out[-1]
            out[-1] = replace(last, more=(*last.more, run.member), step=last.step or run.offset - last.offset)
        else:
            out.append(run)
    return tuple(out)


def _joins(group: Run, run: Run, after: Mapping[int, int]) -> bool:
    if after.get(group.members[-1]) != run.member:
        return False
    if (group.row, group.rows, group.count, group.stride) != (run.row, run.rows, run.count, run.stride):
        return False
    step = group.step or run.offset - group.offset
    return step > 0 and run.offset == group.offset + len(group.members) * step


def segments(cols: Sequence[int | None]) -> tuple[tuple[int, int, int | None], ...]:
    """Consecutive pieces packed together into a flat buffer: (first, stop, cols) of each maximal
    run of at least two 2-D pieces with the same ``cols`` (one row-wise ``cat`` into a 2-D view),
    and (first, stop, None) of the pieces between (flattened, one ``cat``); ``None``: not 2-D."""
    out: list[tuple[int, int, int | None]] = []
    i = 0
    while i < len(cols):
        j = i + 1
        while j < len(cols) and cols[i] is not None and cols[j] == cols[i]:
            j += 1
        if j - i > 1:
            out.append((i, j, cols[i]))
        elif out and out[-1][2] is None:
            out[-1] = (out[-1][0], j, None)
        else:
            out.append((i, j, None))
        i = j
    return tuple(out)


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
