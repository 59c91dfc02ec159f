"""The matrices of a parameter, and where each rank's piece of each sits: pure data.

A 2-D parameter is one matrix. A 3-D parameter ``[E, m, n]`` is E expert matrices. A conv weight
``(out, in, kh, kw)`` is one ``(out, in*kh*kw)`` matrix when its group says ``flatten=True``.
``split_sizes`` cuts the rows of each matrix into blocks orthogonalized separately (a fused q/k/v).
Each view carries its global shape, every group rank's block of it (for the plan) and where this
rank's piece sits in its local tensor (for cutting the input and placing the result).
With ``lead`` > 0 (NorMuon) each matrix has ``lead`` extra leading columns that carry the parameter's
per-row second moment; the ranks that hold the parameter's column 0 hold them (torch.chunk puts the
state's single column where the parameter's column 0 is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...base.weak_memo import WeakMemo
from ...numerics.split_ns import part_sizes
from .blocks import Block, Interval, take

__all__ = ["LocalCut", "View", "holds_first_column", "matrix_views", "split_view", "whole_matrix"]

_EMPTY: tuple[Interval, ...] = ((0, 0),)


@dataclass(frozen=True)
class LocalCut:
    """This rank's piece of a view inside its local tensor: an index along the expert dimension
    (3-D parameters), local row intervals, and local column intervals (trailing dims flattened;
    None: all of them, as every view but a split matrix's part has)."""

    expert: int | None
    rows: tuple[Interval, ...]
    cols: tuple[Interval, ...] | None = None


@dataclass(frozen=True)
class View:
    shape: tuple[int, int]  # with the ``lead`` columns
    blocks: tuple[Block, ...]  # per group rank, in the view's own coordinates
    local: LocalCut
    lead: int = 0  # leading columns that are not the parameter's (NorMuon's packed second moment)
    whole: tuple[int, int] | None = None  # a split matrix's part: the matrix's shape

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """The parameter's matrix, without the ``lead`` columns (what the lr adjustment reads)."""
        return self.whole or (self.shape[0], self.shape[1] - self.lead)

    def cut(self, local: Tensor) -> Tensor:
        """This rank's piece of the matrix from its local tensor, 2-D (a view when contiguous)."""
        c = self.local
        t = local[c.expert] if c.expert is not None else local
        if t.ndim == 0 or t.numel() == 0 or c.rows == _EMPTY:
            return local.new_empty((0, 0))
        t = t if t.ndim == 2 else t.reshape(t.shape[0], -1)
        if c.rows == ((0, t.shape[0]),):
            rows = t  # every local row (a whole-matrix parameter): no slice op
        elif len(c.rows) == 1:
            rows = t[c.rows[0][0] : c.rows[0][1]]
        else:
            rows = torch.cat([t[a:b] for a, b in c.rows])
        if c.cols is None:
            return rows
        if c.cols == _EMPTY:
            return local.new_empty((0, 0))
        if len(c.cols) == 1:
            return rows[:, c.cols[0][0] : c.cols[0][1]]
        return torch.cat([rows[:, a:b] for a, b in c.cols], dim=1)

    def place(self, dest: Tensor, value: Tensor) -> None:
        """Write ``value`` (this rank's piece) where ``cut`` took it from; ``dest`` is contiguous."""
        if value.numel() == 0:
            return
        c = self.local
        t = dest[c.expert] if c.expert is not None else dest
        t = t.view(t.shape[0], -1)
        cols = c.cols or ((0, t.shape[1]),)
        offset = 0
        for a, b in c.rows:
            inner = 0
            for x, y in cols:
                t[a:b, x:y] = value[offset : offset + b - a, inner : inner + y - x]
                inner += y - x
            offset += b - a


def whole_matrix(views: Sequence[View], local_shape: Sequence[int]) -> bool:
    """A 2-D parameter that is one matrix: its piece of the result is its update, with no assembly."""
    return (
        len(local_shape) == 2
        and len(views) == 1
        and views[0].local == LocalCut(None, ((0, int(local_shape[0])),))
    )


def _intersect(
    intervals: Sequence[Interval], lo: int, hi: int
) -> tuple[tuple[Interval, ...], tuple[Interval, ...]]:
    """Global intervals inside [lo, hi) shifted to the view, and their positions in the local tensor."""
    view, local, offset = [], [], 0
    for a, b in intervals:
        x, y = max(a, lo), min(b, hi)
        if x < y:
            view.append((x - lo, y - lo))
            local.append((offset + x - a, offset + y - a))
        offset += b - a
    return tuple(view) or _EMPTY, tuple(local) or _EMPTY


def _flat_cols(block: Block, shape: Sequence[int], name: str) -> tuple[Interval, ...]:
    """Column intervals of ``(out, prod(shape[1:]))`` from a block over ``shape``."""
    inner = math.prod(shape[2:])
    for d in range(2, len(shape)):
        if block[d] != ((0, shape[d]),) and block[d] != _EMPTY:
            raise ValueError(
                f"parameter '{name}' is sharded on dimension {d}; flatten=True needs dims >= 2 whole"
            )
    return tuple((a * inner, b * inner) for a, b in block[1])


def holds_first_column(block: Block) -> bool:
    """Whether a rank with ``block`` of a parameter holds its column 0 (the last dimension's)."""
    return _has(block[-1], 0) is not None


def _lead(cols: tuple[Interval, ...], lead: int, holds: bool) -> tuple[Interval, ...]:
    """Column intervals with ``lead`` leading columns in front: the parameter's shifted right, and
    ``(0, lead)`` first on a rank that ``holds`` them (adjacent intervals merged, so a whole row
    stays one interval and a replicated matrix stays recognizable)."""
    if not lead:
        return cols
    out = [(0, lead)] if holds else []
    for a, b in cols:
        if a == b:
            continue
        if out and out[-1][1] == a + lead:
            out[-1] = (out[-1][0], b + lead)
        else:
            out.append((a + lead, b + lead))
    return tuple(out) or _EMPTY


def _has(intervals: Sequence[Interval], index: int) -> int | None:
    """Local position of global ``index`` in the concatenation of ``intervals``, or None."""
    offset = 0
    for a, b in intervals:
        if a <= index < b:
            return offset + index - a
        offset += b - a
    return None


def matrix_views(
    shape: Sequence[int],
    blocks: Sequence[Block],
    rank: int,
    *,
    name: str,
    flatten: bool = False,
    experts: bool = False,
    split_sizes: Sequence[int] | None = None,
    head_dim: int | None = None,
    lead: int = 0,
) -> list[View]:
    """Every matrix of a parameter of global ``shape`` whose group ranks hold ``blocks``: row blocks
    of ``split_sizes``, each cut into heads of ``head_dim`` rows if set, with ``lead`` leading
    columns (NorMuon). A parameter with no elements has none (torch.optim.Muon steps it as a no-op,
    so do we)."""
    if math.prod(shape) == 0:
        return []
    experts = experts and len(shape) == 3
    rows_dim = 1 if experts else 0
    rows = shape[rows_dim]
    cols = shape[2] if experts else math.prod(shape[1:])
    splits = list(split_sizes) if split_sizes else [rows]  # validation.check_params checked them
    if head_dim:
        splits = [head_dim for size in splits for _ in range(size // head_dim)]
    views = []
    for e in range(shape[0]) if experts else [None]:
        start = 0
        for size in splits:
            view = _view(shape, blocks, rank, e, start, start + size, cols, rows_dim, name)
            views.append(_with_lead(view, blocks, lead) if lead else view)
            start += size
    return views


def _view(
    shape: Sequence[int],
    blocks: Sequence[Block],
    rank: int,
    expert: int | None,
    lo: int,
    hi: int,
    cols: int,
    rows_dim: int,
    name: str,
) -> View:
    view_blocks = _view_blocks(shape, blocks, expert, lo, hi, rows_dim, name)
    mine = blocks[rank]
    local_expert = _has(mine[0], expert) if expert is not None else None
    has_piece = expert is None or local_expert is not None
    local_rows = _intersect(mine[rows_dim], lo, hi)[1] if has_piece else _EMPTY
    return View((hi - lo, cols), tuple(view_blocks), LocalCut(local_expert, local_rows))


# _view_blocks' memo: (id of a blocks tuple, shape, expert, rows) -> (the tuple, kept alive so the id
# stays its own; every rank's block of the view). A model's matrices share a few layouts, so a set-up
# cuts each layout's blocks once, O(ranks), and every parameter of it in O(1).
# per blocks tuple, per (shape, expert, lo, hi, rows_dim): the view's blocks
_VIEW_BLOCKS: WeakMemo[dict[tuple, tuple[Block, ...]]] = WeakMemo(limit=4096)
VIEW_BLOCK_CUTS = [0]  # blocks cut (one per rank per distinct layout), for tests that bound set-up work


def _view_blocks(
    shape: Sequence[int],
    blocks: Sequence[Block],
    expert: int | None,
    lo: int,
    hi: int,
    rows_dim: int,
    name: str,
) -> tuple[Block, ...]:
    """Every group rank's block of the view (rows ``lo:hi`` of ``expert``, if any)."""
    per_blocks = _VIEW_BLOCKS.get(blocks)
    if per_blocks is None:
        per_blocks = _VIEW_BLOCKS.put(blocks, {})
    key = (tuple(shape), expert, lo, hi, rows_dim)
    hit = per_blocks.get(key)
    if hit is not None:
        return hit
    out: list[Block] = []
    for block in blocks:
        if expert is not None and _has(block[0], expert) is None:
            out.append((_EMPTY, _EMPTY))
            continue
        col_iv = (
            block[2]
            if expert is not None
            else (_flat_cols(block, shape, name) if len(shape) > 2 else block[1])
        )
        out.append((_intersect(block[rows_dim], lo, hi)[0], col_iv))
    VIEW_BLOCK_CUTS[0] += len(out)
    hit = per_blocks[key] = tuple(out)
    return hit


def _with_lead(view: View, blocks: Sequence[Block], lead: int) -> View:
    """``view`` with ``lead`` leading columns, held by the ranks that hold the parameter's column 0."""
    extended = tuple(
        (rows, _lead(cols, lead, holds_first_column(block)) if rows != _EMPTY or cols != _EMPTY else cols)
        for (rows, cols), block in zip(view.blocks, blocks)
    )
    return View((view.shape[0], view.shape[1] + lead), extended, view.local, lead)


def _compose(outer: Sequence[Interval], inner: Sequence[Interval]) -> tuple[Interval, ...]:
    """Positions ``inner`` in the concatenation of intervals ``outer``, as intervals of what
    ``outer`` indexes (a part's rows of a piece, as rows of the local tensor)."""
    return tuple(piece for lo, hi in inner for piece in take(outer, lo, hi)) or _EMPTY


def split_view(view: View, k: int, rank: int) -> list[View]:
    """The ``k`` parts of a split matrix (``split_ns.py``), for group rank ``rank``: column blocks
    of its wide form, so column ranges of a wide view and row ranges of a tall one, cut as
    ``tensor_split`` cuts them. Each part is a view with its blocks rebased to the part and this
    rank's piece of it; ``matrix_shape`` stays the matrix's (the lr adjustment reads it)."""
    assert view.lead == 0, "NorMuon's matrices are not split"
    axis = 0 if view.shape[0] > view.shape[1] else 1
    parts, lo = [], 0
    for size in part_sizes(view.shape[axis], k):
        hi = lo + size
        blocks = tuple(_part_block(b, axis, lo, hi) for b in view.blocks)
        shape = (size, view.shape[1]) if axis == 0 else (view.shape[0], size)
        local = _part_local(view.local, view.blocks[rank][axis], axis, lo, hi)
        parts.append(View(shape, blocks, local, whole=view.shape))
        lo = hi
    return parts


def _part_block(block: Block, axis: int, lo: int, hi: int) -> Block:
    if block[axis] == _EMPTY:
        return block
    cut = _intersect(block[axis], lo, hi)[0]
    return (cut, block[1]) if axis == 0 else (block[0], cut)


def _part_local(local: LocalCut, mine: Sequence[Interval], axis: int, lo: int, hi: int) -> LocalCut:
    """Where this rank's piece of a part sits: rows of the piece mapped through the view's local
    rows (a tall part), or the piece's columns, which are the local tensor's (a wide part)."""
    if local.rows == _EMPTY or mine == _EMPTY:
        return LocalCut(local.expert, _EMPTY, _EMPTY)
    positions = _intersect(mine, lo, hi)[1]
    if axis == 0:
        return LocalCut(local.expert, _compose(local.rows, positions) if positions != _EMPTY else _EMPTY)
    return LocalCut(local.expert, local.rows, positions)
