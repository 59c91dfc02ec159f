"""NorMuon on an owner's full matrices: pure, shard-agnostic, no ``torch.distributed``.

NorMuon (Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491) normalizes
each output row of Muon's orthogonalized update by a running second moment. Per matrix, after
Newton-Schulz gives ``O`` (m x n), with state ``v`` (m x 1, zeros at first), as the authors' official
``normuon_update`` (github.com/zichongli5/NorMuon, normuon.py) does it::

    vnorm = ||O||_F
    v     = lerp(v, mean_j O_ij^2, 1 - beta2)           (per row i; beta2 = 0.95 by default)
    U     = O * 1 / (sqrt(v) + 1e-10)
    U     = U * vnorm / (||U||_F + 1e-10)                (the update keeps O's norm)

Here ``O`` is taken in float32 and so is ``v`` (the official code computes in the dtype Newton-Schulz
returns, bfloat16); a bfloat16 parameter stores ``v`` rounded to its dtype, after the step that
computed it used the float32 value. ``lerp`` is spelled as single ops.

The row statistics need the whole row, so they run on the owner that holds the whole matrix: the
previous ``v`` travels with the matrix as ``width`` extra leading columns that carry its float32
bits in the Newton-Schulz dtype (``pack``), and the new ``v`` travels back the same way in front of
``U``; ``U`` travels in the Newton-Schulz dtype, as plain Muon's ``O`` does (one rounding of the
normalized update). Each matrix is computed on its own with single elementwise ops and per-row /
per-matrix reductions, so its result does not depend on which other matrices share the owner's
batch (docs/design.md, "Why a sharded step is exactly ...").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .newton_schulz import NSConfig, orthogonalize

__all__ = [
    "DEFAULT_BETA2",
    "NORMUON_EPS",
    "normuon_orthogonalize",
    "normuon_rows",
    "pack",
    "packed_width",
    "unpack",
]

DEFAULT_BETA2 = 0.95  # the official NorMuon's default
NORMUON_EPS = 1e-10  # the official normuon_update's 1e-10, in both denominators


def packed_width(dtype: torch.dtype) -> int:
    """Columns of ``dtype`` that carry one float32 value: 2 for bfloat16, 1 for float32."""
    return 4 // dtype.itemsize


def pack(v: Tensor, dtype: torch.dtype) -> Tensor:
    """A float32 column ``[..., rows, 1]`` as ``[..., rows, packed_width(dtype)]`` of ``dtype``: the same
    bits, reinterpreted (no rounding), so the column can travel inside a matrix of ``dtype``."""
    return v.to(torch.float32).contiguous().view(dtype)


def unpack(packed: Tensor) -> Tensor:
    """The float32 column ``pack`` packed (an empty piece gives an empty column)."""
    rows = packed.shape[:-1]
    if packed.numel() == 0:
        return packed.new_empty((*rows, 1 if packed.shape[-1] else 0), dtype=torch.float32)
    # Through one flat run of elements: a one-row slice counts as contiguous with its parent's row
    # stride, which a dtype view refuses.
    return packed.reshape(-1).view(torch.float32).reshape(*rows, 1)


def _lerp(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """``torch.lerp``'s formula as single ops (no fused multiply-add, so no dependence on where an
    element sits in its buffer): ``start + w (end - start)``, or ``end - (end - start)(1 - w)`` for
    ``w >= 0.5`` (ATen's ``lerp`` picks the form the same way)."""
    if weight < 0.5:
        return start + (end - start) * weight
    return end - (end - start) * (1.0 - weight)


def normuon_rows(o: Tensor, v: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """One matrix's NorMuon step: ``O`` (m x n, any float dtype) and the previous ``v`` (m x 1,
    float32) to the new ``v`` and the normalized update ``U``, both float32."""
    of = o.to(torch.float32)
    vnorm = of.norm()
    v_new = _lerp(v, (of * of).mean(dim=-1, keepdim=True), 1.0 - beta2)
    u = of * (1.0 / (v_new.sqrt() + NORMUON_EPS))
    u = u * (vnorm / (u.norm() + NORMUON_EPS))
    return v_new, u


def normuon_orthogonalize(
    matrices: Sequence[Tensor],
    config: NSConfig,
    *,
    beta2: float,
    base: Callable[[Sequence[Tensor], NSConfig], list[Tensor]] = orthogonalize,
) -> list[Tensor]:
    """The owner's compute for NorMuon: same-shape full matrices ``[m, width + n]`` (the packed ``v``,
    then the Newton-Schulz input) to ``[m, width + n]`` (the packed new ``v``, then ``U``), in
    ``config.dtype``; ``base`` orthogonalizes the inputs."""
    width = packed_width(config.dtype)
    inputs = [m[:, width:].contiguous() for m in matrices]
    out = []
    for full, o in zip(matrices, base(inputs, config)):
        v, u = normuon_rows(o, unpack(full[:, :width]), beta2)
        out.append(torch.cat([pack(v, config.dtype), u.to(config.dtype)], dim=-1))
    return out
