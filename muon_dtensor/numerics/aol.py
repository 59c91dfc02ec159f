"""AOL preconditioning for Newton-Schulz (Turbo-Muon, arXiv 2512.04632): pure, per matrix.

The source is thib-s/flash-newton-schulz at commit cdb03db0e6c59e82365426373a1601fadfdf7ab3,
``newton_schulz_triton.py`` L549-599, ``newton_schulz_triton_aol`` ("triton_aol.py@cdb03db" below).
Instead of dividing by the Frobenius norm it scales each row of the wide matrix ``X`` (``X^T`` when
tall) by ``s_i = rsqrt(max(sum_j |A_ij|, eps))`` with ``A = X X^T`` (AOL, Prach and Lampert,
arXiv 2208.03160): ``D A D`` with ``D = diag(s)`` has every row's absolute sum at most 1, so the
spectral norm of ``D X`` is at most 1 (Gershgorin on ``D A D``), and it is usually far larger than
after the Frobenius division, which is why 4 steps do what 5 did. ``A`` is the product the first
iteration needs anyway: the scaled ``D A D`` is that iteration's Gram matrix, so the scaling costs
no matrix product. triton_aol.py@cdb03db L578-587::

    ns_line_1(X, out=A)                                             # A = X @ X.mT
    s = torch.rsqrt(torch.clamp_min(A.abs().sum(dim=-1, keepdim=False), min=epsilon))
    X = X * s.unsqueeze(-1)
    a, b, c = ns_consts[0]
    A = A * s.unsqueeze(-1) * s.unsqueeze(-2)
    ns_line_2(A, alpha=c, beta=b, out=B)                            # B = b A + c A A
    ns_line_3(B, X, a, out=C)                                       # C = a X + B X

with ``X``, ``A`` and ``s`` in bfloat16 (L560: ``G.to(dtype=torch.bfloat16)``) and ``epsilon=1e-7``
(L549), the clamp on the row sum (a squared scale), not on a norm. Here every tensor is in the
config's dtype (bfloat16 by default, as there) and ``eps`` is the group's ``eps`` (1e-7 by
default, the source's value). The repository has no pure-torch AOL function in that file
(``newton_schulz_torch``, L476-504, is Dion's Frobenius iteration); ``hp-opt-aol-poly.py``
L317-352 (``orthogonalize(G, ns_consts, aol=True)``) is one, in the input's dtype with a clamp of
1e-12. tests/numerics/test_aol.py transcribes both and runs them against ``newton_schulz``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .elementwise import wider

__all__ = ["aol_scale"]


def aol_scale(
    y: Tensor, eps: float, norm_scale: float, mm: Callable[..., Tensor], tall: bool
) -> tuple[Tensor, Tensor]:
    """``(D y, D A D)`` for a matrix or batch ``y`` in its own dtype: ``A = y y^T`` (``y^T y`` and
    the columns scaled when tall: the short side, as the source's transpose does), ``D`` from the
    absolute row sums of ``A``. Every reduction is over one matrix's last dimension, so a matrix's
    bits do not depend on its batch. ``norm_scale`` (a preset's margin, 1.02 for Polar Express)
    divides the scale as it multiplies the Frobenius norm; 1.0 (turbo_muon) is the source's."""
    gram = mm(y.mT, y) if tall else mm(y, y.mT)
    # The source's order: |A| summed along the last dimension, clamped, then rsqrt; A = A s_i s_j
    # rounded once per factor, row first. Not ``torch.rsqrt``: on CPU its vectorized loop and its
    # scalar tail round differently, so a matrix's scale would depend on where its rows fall in the
    # batch (measured in bfloat16, torch 2.13). sqrt and division are correctly rounded
    # everywhere; in float32 at least, they round to the source's rsqrt but for rare ties.
    total = gram.abs().sum(dim=-1).clamp_min(eps)
    wide = wider(total.dtype, torch.float32)
    scale = total.to(wide).sqrt().reciprocal().to(total.dtype)
    if norm_scale != 1.0:
        scale = scale / norm_scale
    # A zero row under eps=0 (its sum 0, its scale inf) stays zero; a Gram matrix that overflowed
    # (an infinite sum) gives a zero matrix, as the Frobenius division by an infinite norm does.
    # Both would be NaN (0 * inf, inf * 0); elsewhere the bits are the source's.
    fits = total.isfinite().all(dim=-1, keepdim=True)
    scale = torch.where(fits & (total > 0), scale, torch.zeros_like(scale))
    rows, cols = scale.unsqueeze(-1), scale.unsqueeze(-2)
    scaled = torch.where(fits.unsqueeze(-1), gram * rows * cols, torch.zeros_like(gram))
    return (y * cols if tall else y * rows), scaled
