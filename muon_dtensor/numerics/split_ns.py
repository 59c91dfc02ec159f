"""Newton-Schulz over column blocks: one matrix's iteration shared by k ranks.

Pure math, no process group. The wide form ``X = [X_1 .. X_k]`` (rows <= cols; a tall matrix is
transposed first, so its blocks are row blocks of the original) is cut into k column blocks, one per
rank (``part_sizes``: ``tensor_split``'s sizes). Every quantity the iteration needs of the whole
matrix is a sum over blocks or a product of small m x m matrices:

- the Frobenius norm: ``|X|^2 = sum_i |X_i|^2``;
- the Gram matrix: ``A = X X^T = sum_i X_i X_i^T`` (m x m, the small side);
- the polynomial ``P = b A + c A A``, by row blocks: block j of rows is ``b A_j + c A_j A``;

and the update is block by block, ``X_i <- a X_i + P X_i``. Block j's rank sums row block j of the
partial Gram matrices (``reduce_rows``: a reduce-scatter), every rank of the matrix gathers A
(``gather_rows``: an all-gather), computes its rows of P and gathers P. So the ``A A`` product is
split too, and each rank computes ``4 m^2 n / k + 2 m^3 / k`` flops per iteration (``split_flops``).

The sums run in block order, in the same way in one process (``LocalGang``) as over ranks
(``sharding/runtime/split_exchange.GangComm``), so a sharded split equals ``split_orthogonalize`` bitwise. Against
the unsplit ``newton_schulz`` only the summation order and the blocking of the products differ:
equal within the rounding of ``config.dtype``, not bitwise. This is the one place where a sharded
result may differ from one process (docs/design.md, "Split Newton-Schulz"; tolerances measured in
tests/numerics/test_split_ns.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from .newton_schulz import NSConfig

__all__ = [
    "GangOps",
    "LocalGang",
    "part_sizes",
    "split_flops",
    "split_newton_schulz",
    "split_orthogonalize",
]


class GangOps(Protocol):
    """The two collectives of a split, over the ranks of each block's matrix ("gang")."""

    def reduce_rows(self, parts: Sequence[Tensor]) -> list[Tensor]:
        """Per block held here: its row block (its index in its gang) of the sum of its gang's
        ``parts``, summed in gang order."""
        ...

    def gather_rows(self, rows: Sequence[Tensor], totals: Sequence[int]) -> list[Tensor]:
        """Per block held here: its gang's row blocks concatenated, ``totals`` rows in all."""
        ...


def part_sizes(length: int, k: int) -> list[int]:
    """Sizes of ``k`` blocks of ``length``, as ``Tensor.tensor_split`` cuts them (the first
    ``length % k`` one longer)."""
    return [length // k + (1 if i < length % k else 0) for i in range(k)]


def split_flops(shape: Sequence[int], k: int, steps: int = 1) -> int:
    """Newton-Schulz flops on the busiest of ``k`` ranks sharing one matrix, ``steps`` iterations:
    ``4 m^2 ceil(n / k) + 2 m^2 ceil(m / k)`` each (m <= n). ``k = 1`` is ``newton_schulz.ns_flops``."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * math.ceil(n / k) + 2 * m * m * math.ceil(m / k))


class LocalGang:
    """``GangOps`` of one process holding all k blocks of one matrix (the reference of a split)."""

    def reduce_rows(self, parts: Sequence[Tensor]) -> list[Tensor]:
        chunks = [p.tensor_split(len(parts), dim=-2) for p in parts]
        out = []
        for j in range(len(parts)):
            total = chunks[0][j].clone()
            for c in chunks[1:]:
                total.add_(c[j])
            out.append(total)
        return out

    def gather_rows(self, rows: Sequence[Tensor], totals: Sequence[int]) -> list[Tensor]:
        full = torch.cat(list(rows), dim=-2)
        assert full.shape[-2] == totals[0], "the row blocks make the whole matrix"
        return [full] * len(rows)


def split_newton_schulz(blocks: Sequence[Tensor], config: NSConfig, ops: GangOps) -> list[Tensor]:
    """Orthogonalize, with ``ops``, the wide matrices whose column blocks here are ``blocks``
    (each ``[m, n_i]`` or a batch ``[B, m, n_i]``); returns the blocks of the results in
    ``config.dtype``. In one process with every block of one matrix: ``ops = LocalGang()``."""
    ys = [b.to(config.dtype).contiguous() for b in blocks]
    sides = [y.shape[-2] for y in ys]
    # |X|^2 summed in at least float32, the accumulation torch's norm uses for bfloat16 inputs.
    acc = torch.promote_types(config.dtype, torch.float32)
    partial = [torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True, dtype=acc).square() for y in ys]
    squares = ops.gather_rows(ops.reduce_rows(partial), [1] * len(ys))
    norms = [s.sqrt().to(config.dtype) for s in squares]
    if config.norm_scale != 1.0:
        norms = [n * config.norm_scale for n in norms]
    ys = [y.div(n.clamp(min=config.eps)) for y, n in zip(ys, norms)]
    batched = bool(ys) and ys[0].ndim == 3
    mm, addmm = (torch.bmm, torch.baddbmm) if batched else (torch.mm, torch.addmm)
    for a, b, c in config.coefficients:
        rows = ops.reduce_rows([mm(y, y.mT) for y in ys])
        grams = ops.gather_rows(rows, sides)
        polys = ops.gather_rows([addmm(r, r, g, beta=b, alpha=c) for r, g in zip(rows, grams)], sides)
        ys = [addmm(y, p, y, beta=a) for y, p in zip(ys, polys)]
    return ys


def split_orthogonalize(x: Tensor, k: int, config: NSConfig) -> Tensor:
    """``x`` (``[m, n]`` or ``[B, m, n]``) orthogonalized as ``k`` ranks would, its wide form cut
    into ``k`` column blocks: the one-process picture of a split, for tests and the reference."""
    if k < 1:
        raise ValueError(f"split_orthogonalize: k (blocks) must be >= 1 but is {k}")
    tall = x.size(-2) > x.size(-1)
    wide = x.mT if tall else x
    if k > wide.size(-1):
        raise ValueError(f"split_orthogonalize: k={k} blocks but the long side has {wide.size(-1)} columns")
    blocks = list(wide.tensor_split(k, dim=-1))
    out = torch.cat(split_newton_schulz(blocks, config, LocalGang()), dim=-1)
    return (out.mT if tall else out).contiguous()
