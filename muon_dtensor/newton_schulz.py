"""Newton-Schulz orthogonalization: pure, batched, shard-agnostic.

Nothing here knows about processes or meshes. Every function takes a batch ``[B, m, n]`` of full
matrices and treats each matrix independently, so the result for one matrix does not depend on which
other matrices share its batch (``tests/test_newton_schulz.py`` checks this bitwise). That property is
what lets an owner rank orthogonalize any subset of matrices and still match a one-process step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BAND_INPUT_FLOOR",
    "DEFAULT_COEFFICIENTS",
    "NSConfig",
    "PRESETS",
    "PRESET_BANDS",
    "newton_schulz",
    "ns_flops",
    "orthogonalize",
    "scalar_map",
]

Triple = tuple[float, float, float]
# What ``ns_coefficients`` may be: a triple for every step, a per-step list, or a preset name.
NSCoefficients = str | Triple | Sequence[Triple]

# Keller Jordan's quintic, the default of KellerJordan/Muon and torch.optim.Muon
# (https://github.com/KellerJordan/Muon/blob/f90a42b/muon.py#L16).
DEFAULT_COEFFICIENTS: Triple = (3.4445, -4.7750, 2.0315)

# Per-step set by You Jiacheng, the default of microsoft/dion's Newton-Schulz kernels.
_YOU: tuple[Triple, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)

# Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932), as used by modded-nanogpt.
_POLAR_EXPRESS: tuple[Triple, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


@dataclass(frozen=True)
class NSConfig:
    """What an orthogonalization needs: one (a, b, c) triple per iteration and the input scaling.

    ``norm_scale`` multiplies the Frobenius norm before dividing by it; Polar Express uses 1.02 so the
    spectral norm is safely below 1 in bfloat16.
    """

    coefficients: tuple[Triple, ...]
    eps: float = 1e-7
    norm_scale: float = 1.0
    dtype: torch.dtype = torch.bfloat16


# name -> (per-step triples, norm_scale). Singular-value bands are checked in tests against float64 SVD.
PRESETS: dict[str, tuple[tuple[Triple, ...], float]] = {
    "keller": ((DEFAULT_COEFFICIENTS,), 1.0),
    "you": (_YOU, 1.0),
    "polar_express": (_POLAR_EXPRESS, 1.02),
}


# Where each preset's output singular values land, for inputs whose singular values are at least
# BAND_INPUT_FLOOR times the Frobenius norm (smaller ones have not converged after 5 steps). Computed
# in float64 by ``scalar_map`` over [0.01, 1] (tests/test_newton_schulz.py checks them by SVD).
BAND_INPUT_FLOOR = 0.01
PRESET_BANDS: dict[str, tuple[float, float]] = {
    "keller": (0.681, 1.135),
    "you": (0.977, 1.032),
    "polar_express": (0.858, 1.142),
}


def newton_schulz(x: Tensor, config: NSConfig) -> Tensor:
    """Orthogonalize a matrix ``[m, n]`` or each matrix of a batch ``[B, m, n]``; returns
    ``config.dtype``, contiguous.

    The iteration of ``torch.optim._muon._zeropower_via_newtonschulz``: cast, divide by the Frobenius
    norm, then ``X <- a X + (b A + c A A) X`` with the small Gram matrix ``A = X X^T``. For a wide or
    square matrix these are exactly its ``mm``/``addmm`` calls (bitwise equal; a batch runs their
    ``bmm``/``baddbmm`` twins). A tall matrix runs the same polynomial from the right,
    ``X <- a X + X (b A + c A A)`` with ``A = X^T X``, instead of transposing in and out: the same
    math and flops, but a contiguous result, so slicing and scaling it are plain copies
    (docs/benchmarks.md). Its bits may differ from torch's within bf16 rounding.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [m, n] or [B, m, n] but got shape {tuple(x.shape)}")
    mm, addmm = (torch.mm, torch.addmm) if x.ndim == 2 else (torch.bmm, torch.baddbmm)
    y = x.to(config.dtype)
    tall = y.size(-2) > y.size(-1)
    norm = y.norm(dim=(-2, -1), keepdim=True)
    if config.norm_scale != 1.0:
        norm = norm * config.norm_scale
    y = y.div(norm.clamp(min=config.eps))
    for a, b, c in config.coefficients:
        if tall:
            gram = mm(y.mT, y)
            poly = addmm(gram, gram, gram, beta=b, alpha=c)
            y = addmm(y, y, poly, beta=a)
        else:
            gram = mm(y, y.mT)
            poly = addmm(gram, gram, gram, beta=b, alpha=c)
            y = addmm(y, poly, y, beta=a)
    return y


def orthogonalize(matrices: Sequence[Tensor], config: NSConfig) -> list[Tensor]:
    """``newton_schulz`` of same-shape matrices, batched where batching pays.

    On CUDA the matrices run as one batched product. On CPU they run one at a time, which is faster
    with oneDNN's bfloat16 GEMMs (docs/benchmarks.md); the bits are the same either way
    (tests/test_newton_schulz.py).
    """
    if not matrices:
        return []
    if matrices[0].device.type == "cpu" or len(matrices) == 1:
        return [newton_schulz(m, config) for m in matrices]
    return list(newton_schulz(torch.stack(list(matrices)), config).unbind(0))


def scalar_map(singular_values: Tensor, config: NSConfig) -> Tensor:
    """What the iteration does to each singular value (as a fraction of the Frobenius norm), in the
    input's dtype: the odd polynomial ``a s + b s^3 + c s^5`` composed once per step."""
    s = singular_values / config.norm_scale
    for a, b, c in config.coefficients:
        s = a * s + b * s**3 + c * s**5
    return s


def ns_flops(shape: Sequence[int], steps: int = 1) -> int:
    """Flops of ``steps`` iterations on one matrix: 4 m^2 n + 2 m^3 each, m <= n (A = X X^T costs
    2 m^2 n, A A 2 m^3, the product with X 2 m^2 n)."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * n + 2 * m * m * m)
