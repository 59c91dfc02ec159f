"""Newton-Schulz over column blocks: one matrix's iteration shared by k ranks (issue 11, item 2).

Pure math, no process group. The wide form ``X = [X_1 .. X_k]`` (rows <= cols; a tall matrix is
transposed first, so its blocks are row blocks of the original) is cut into k column blocks, one per
rank. Every quantity the iteration needs of the whole matrix is a sum over blocks:

- the Frobenius norm: ``|X|^2 = sum_i |X_i|^2``;
- the Gram matrix: ``A = X X^T = sum_i X_i X_i^T`` (m x m, small side);

and the update is block by block, ``X_i <- a X_i + (b A + c A A) X_i``, because ``(b A + c A A)``
multiplies ``X`` from the left. So each rank computes its partial sums, a ``reduce`` adds them up
(an all-reduce of m x m in a real run; in one process, a plain sum over the blocks), and each rank
updates its own block. The polynomial is exactly ``newton_schulz``'s; only the order in which the
Gram matrix's terms are summed differs, so the result equals the one-process result within the
rounding of ``config.dtype`` (bitwise it may differ). This is the one place where a sharded result
may differ from one process (docs/design.md, "Split Newton-Schulz"). Not wired into the step yet.

Per rank and iteration: ``A_i`` costs ``2 m^2 n / k`` flops, ``A A`` ``2 m^3`` (every rank, on the
reduced ``A``), the update ``2 m^2 n / k``: ``4 m^2 n / k + 2 m^3`` (``planning/split.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .newton_schulz import NSConfig

__all__ = ["Reduce", "split_newton_schulz", "split_orthogonalize", "sum_blocks"]

# Partial sums of the blocks this caller holds -> the sum over all blocks of the matrix.
Reduce = Callable[[Sequence[Tensor]], Tensor]


def sum_blocks(parts: Sequence[Tensor]) -> Tensor:
    """The reduce of one process holding every block: the partial sums added in block order."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def split_newton_schulz(
    blocks: Sequence[Tensor], config: NSConfig, reduce: Reduce = sum_blocks
) -> list[Tensor]:
    """Orthogonalize the wide matrix whose column blocks are ``blocks`` (each ``[m, n_i]`` or a batch
    ``[B, m, n_i]``, ``m <= sum n_i``); returns the blocks of the result in ``config.dtype``.

    ``reduce`` turns the partial sums of ``blocks`` into the sum over the whole matrix: with every
    block here, ``sum_blocks``; with one block per rank, an all-reduce over the ranks sharing it.
    """
    if not blocks:
        raise ValueError("split_newton_schulz needs at least one block but got none")
    _check_blocks(blocks)
    batched = blocks[0].ndim == 3
    mm, addmm = (torch.bmm, torch.baddbmm) if batched else (torch.mm, torch.addmm)
    ys = [b.to(config.dtype) for b in blocks]
    # |X|^2 summed in at least float32, the accumulation torch's norm uses for bfloat16 inputs.
    acc = torch.promote_types(config.dtype, torch.float32)
    squares = reduce([_norm(y, acc).square() for y in ys])
    norm = squares.sqrt().to(config.dtype)
    if config.norm_scale != 1.0:
        norm = norm * config.norm_scale
    norm = norm.clamp(min=config.eps)
    ys = [y.div(norm) for y in ys]
    for a, b, c in config.coefficients:
        gram = reduce([mm(y, y.mT) for y in ys])
        poly = addmm(gram, gram, gram, beta=b, alpha=c)
        ys = [addmm(y, poly, y, beta=a) for y in ys]
    return ys


def _norm(y: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True, dtype=dtype)


def _check_blocks(blocks: Sequence[Tensor]) -> None:
    """Every block has the same rank (2 or 3), rows and batch; the whole matrix is wide or square."""
    first = blocks[0]
    if first.ndim not in (2, 3):
        raise ValueError(
            f"split_newton_schulz expects blocks [m, n_i] or [B, m, n_i] but got {tuple(first.shape)}"
        )
    lead = first.shape[:-1]
    for i, b in enumerate(blocks):
        if b.ndim != first.ndim or b.shape[:-1] != lead:
            raise ValueError(
                f"split_newton_schulz: block {i} has shape {tuple(b.shape)} but block 0 has "
                f"{tuple(first.shape)}; blocks must share every dimension but the last (columns)"
            )
    cols = sum(b.shape[-1] for b in blocks)
    if first.shape[-2] > cols:
        raise ValueError(
            f"split_newton_schulz: the blocks form a tall matrix ({first.shape[-2]} x {cols}); "
            "pass the column blocks of its transpose (rows <= cols)"
        )


def split_orthogonalize(x: Tensor, k: int, config: NSConfig, reduce: Reduce = sum_blocks) -> Tensor:
    """``split_newton_schulz`` of ``x`` (``[m, n]`` or ``[B, m, n]``) cut into ``k`` column blocks of
    its wide form, reassembled: the one-process picture of a split, for tests and the reference."""
    if k < 1:
        raise ValueError(f"split_orthogonalize: k (blocks) must be >= 1 but is {k}")
    tall = x.size(-2) > x.size(-1)
    wide = x.mT if tall else x
    if k > wide.size(-1):
        raise ValueError(f"split_orthogonalize: k={k} blocks but the long side has {wide.size(-1)} columns")
    parts = split_newton_schulz(list(wide.tensor_split(k, dim=-1)), config, reduce)
    out = torch.cat(parts, dim=-1)
    return (out.mT if tall else out).contiguous()
