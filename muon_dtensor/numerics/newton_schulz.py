"""Newton-Schulz orthogonalization: pure, batched, shard-agnostic.

Nothing here knows about processes or meshes. Every function takes a batch ``[B, m, n]`` of full
matrices and treats each matrix independently, so the result for one matrix does not depend on which
other matrices share its batch, given one BLAS thread (``tests/numerics/test_newton_schulz.py`` checks this
bitwise; with several, MKL may cut a lone product's work another way than a batch's). That property
is what lets an owner rank orthogonalize any subset of matrices and still match a one-process step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from .aol import aol_scale

__all__ = [
    "NSAlgorithm",
    "ALGORITHMS",
    "AOL_PRESETS",
    "BAND_INPUT_FLOOR",
    "BATCH_ENV",
    "BATCH_VALUES",
    "DEFAULT_COEFFICIENTS",
    "GRAM_DRIFT_LIMIT",
    "PRESETS",
    "PRESET_BANDS",
    "PRESET_STEPS",
    "NSConfig",
    "batching",
    "gram_segments",
    "newton_schulz",
    "ns_flops",
    "orthogonalize",
    "orthogonalize_flops",
    "scalar_map",
    "stacked",
    "uses_gram",
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

# The three below are copied from NVIDIA-NeMo/Emerging-Optimizers (EO),
# https://github.com/NVIDIA-NeMo/Emerging-Optimizers/blob/fd7729267109a8848709e9406bf19e53e970c3f4/emerging_optimizers/orthogonalized_optimizers/muon_utils.py
# ("muon_utils.py@fd77292" below), whose newton_schulz runs them as given after dividing by the
# Frobenius norm (no norm scale); tests/numerics/test_ns_presets.py runs that code's iteration against ours.

# DeepSeek-V4's hybrid (https://huggingface.co/deepseek-ai/DeepSeek-V4-Pro/blob/main/DeepSeek_V4.pdf,
# Algorithm 1, as quoted in microsoft/dion issue #66 and PR #67): 8 steps of Keller's quintic to
# converge, then 2 of (2, -1.5, 0.5), whose fixed point 1 has slope 0. muon_utils.py@fd77292 L75-77
# (added by EO PR #167, commit dd79ab1).
_DEEPSEEK_V4: tuple[Triple, ...] = (DEFAULT_COEFFICIENTS,) * 8 + ((2.0, -1.5, 0.5),) * 2

# CANS, Chebyshev-accelerated Newton-Schulz (Grishina, Smirnov, Rakhuba, arXiv 2506.10935; Remez with
# an adaptive interval): muon_utils.py@fd77292 L58-67 (added by EO PR #140, commit 67c47ac).
_CANS: tuple[Triple, ...] = (
    (8.4703, -25.1081, 18.6293),
    (4.1828, -3.1087, 0.5806),
    (3.9619, -2.9541, 0.5630),
    (3.2866, -2.4647, 0.5074),
    (2.2737, -1.6447, 0.4162),
)

# Cubic5, a relaxed cubic schedule (arXiv 2606.00371; optimized for a relaxed singular-value band,
# here [0.774, 1.3], with a bf16 lower bound of 7e-3): muon_utils.py@fd77292 L78-89 (added by EO PR
# #217, commit a4c2c26). c = 0: the A A product is skipped, as EO does (``_small_poly``).
_CUBIC5: tuple[Triple, ...] = (
    (3.3656576, -3.3420992, 0.0),
    (2.5744352, -1.4957376, 0.0),
    (2.5368962, -1.4312570, 0.0),
    (2.4418906, -1.2764040, 0.0),
    (2.2230472, -0.9630650, 0.0),
)

# Turbo-Muon's 4 steps, fitted to inputs scaled by AOL (``ns_algorithm="aol"``, numerics/aol.py):
# thib-s/flash-newton-schulz@cdb03db newton_schulz_triton.py L554-559 (``newton_schulz_triton_aol``),
# run as given, no norm scale; tests/numerics/test_aol.py runs that code's iteration against ours.
_TURBO_MUON: tuple[Triple, ...] = (
    (4.6051, -9.6552, 5.6769),
    (4.7505, -6.0861, 2.1790),
    (2.7763, -2.3190, 0.5523),
    (2.4231, -2.2861, 0.8193),
)


@dataclass(frozen=True)
class NSConfig:
    """What an orthogonalization needs: one (a, b, c) triple per iteration, the input scaling and
    how the iterations are evaluated.

    ``norm_scale`` multiplies the Frobenius norm before dividing by it; Polar Express uses 1.02 so the
    spectral norm is safely below 1 in bfloat16. ``algorithm``: ``"standard"`` (torch's iteration) or
    ``"gram"`` (the same polynomial evaluated on the small Gram matrix where that saves flops) or
    ``"aol"`` (AOL's row scaling in place of the Frobenius division, then the standard iteration).
    """

    coefficients: tuple[Triple, ...]
    eps: float = 1e-7
    norm_scale: float = 1.0
    dtype: torch.dtype = torch.bfloat16
    algorithm: str = "standard"


# name -> (per-step triples, norm_scale). Singular-value bands are checked in tests against float64 SVD.
PRESETS: dict[str, tuple[tuple[Triple, ...], float]] = {
    "keller": ((DEFAULT_COEFFICIENTS,), 1.0),
    "you": (_YOU, 1.0),
    "polar_express": (_POLAR_EXPRESS, 1.02),
    "deepseek_v4": (_DEEPSEEK_V4, 1.0),
    "cans": (_CANS, 1.0),
    "cubic5": (_CUBIC5, 1.0),
    "turbo_muon": (_TURBO_MUON, 1.0),
}
# Presets fitted to AOL-scaled inputs: ``resolve_ns_config`` runs them only with ns_algorithm="aol".
AOL_PRESETS: frozenset[str] = frozenset({"turbo_muon"})

# The iterations a preset is made for, which its band assumes: its table's length, at least Muon's
# default 5 (Keller's one triple repeats). ``resolve_ns_config`` runs ``ns_steps`` as given (fewer
# stop early, more repeat the last triple, as EO's "repeat_last"): deepseek_v4 needs ns_steps=10.
# turbo_muon: its table's 4, the step AOL saves (the source runs exactly 4).
PRESET_STEPS: dict[str, int] = {
    name: len(triples) if name in AOL_PRESETS else max(5, len(triples))
    for name, (triples, _) in PRESETS.items()
}

# Where each preset's output singular values land after PRESET_STEPS iterations, for inputs whose
# singular values are at least BAND_INPUT_FLOOR times the Frobenius norm (smaller ones have not
# converged after 5 steps; for turbo_muon, at least BAND_INPUT_FLOOR after AOL's scaling, which
# bounds them by 1 as the Frobenius norm does). Computed in float64 by ``scalar_map`` over [0.01, 1], rounded outward to
# 3 decimals (tests/numerics/test_ns_presets.py recomputes them; tests/numerics/test_newton_schulz.py checks them by SVD).
BAND_INPUT_FLOOR = 0.01
PRESET_BANDS: dict[str, tuple[float, float]] = {
    "keller": (0.681, 1.135),
    "you": (0.977, 1.032),
    "polar_express": (0.858, 1.142),
    "deepseek_v4": (0.999, 1.001),
    "cans": (0.884, 1.120),
    "cubic5": (0.774, 1.300),
    "turbo_muon": (0.940, 1.051),
}

# How ``ns_algorithm`` evaluates the iterations: "standard" is torch's; "gram" runs the same
# polynomial on the small Gram matrix (Gram Newton-Schulz, Zhang, Amsel, Chen, Dao 2026,
# https://github.com/Dao-AILab/gram-newton-schulz/blob/main/gram_newton_schulz/gram_newton_schulz.py,
# which runs it in float16 with one restart; microsoft/dion uses that package); "aol" scales by AOL
# (numerics/aol.py) instead of the Frobenius norm and reuses the scaled Gram matrix in step 1.
NSAlgorithm = Literal["standard", "gram", "aol"]
ALGORITHMS: tuple[str, ...] = get_args(NSAlgorithm)
# Rounding gives the Gram matrix R of an ill-conditioned input eigenvalues slightly below zero, and
# each update R <- P R P multiplies them by about a^2 (P = a I + b R + c R^2 near a small eigenvalue):
# the output leaves its band (in bfloat16, largest singular values of 1.4 with one restart, 1e6 to
# 1e17 with none). A restart recomputes R from the true X. The rule: restart before an update would
# make the product of the a^2 since the last restart, times the dtype's machine epsilon, exceed
# GRAM_DRIFT_LIMIT. In bfloat16 that allows one update per restart (Keller: restarts before
# iterations 2 and 4 of 5; Polar Express, a = 8.16 first: 1 and 3); in float32, 5 steps need none.
# Measured: docs/benchmarks.md, "Gram Newton-Schulz".
GRAM_DRIFT_LIMIT = 0.16


def gram_segments(config: NSConfig) -> list[range]:
    """The iterations the Gram form runs between restarts (``GRAM_DRIFT_LIMIT``)."""
    eps = torch.finfo(config.dtype).eps
    starts, growth = [0], 1.0
    for k in range(1, len(config.coefficients)):
        a = config.coefficients[k - 1][0]  # the update of R between iterations k - 1 and k
        growth *= a * a
        if growth * eps > GRAM_DRIFT_LIMIT:
            starts.append(k)
            growth = 1.0
    bounds = [*starts, len(config.coefficients)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def uses_gram(shape: Sequence[int], config: NSConfig) -> bool:
    """Whether ``newton_schulz`` evaluates this shape in the Gram form: asked for and fewer flops
    (with 5 steps, long side over 1.5x the short one; square matrices stay standard)."""
    steps = len(config.coefficients)
    return config.algorithm == "gram" and _gram_flops(shape, gram_segments(config)) < ns_flops(shape, steps)


def newton_schulz(x: Tensor, config: NSConfig) -> Tensor:
    """Orthogonalize a matrix ``[m, n]`` or each matrix of a batch ``[B, m, n]``; returns
    ``config.dtype``, contiguous.

    The iteration of ``torch.optim._muon._zeropower_via_newtonschulz``: cast, divide by the Frobenius
    norm, then ``X <- a X + (b A + c A A) X`` with the small Gram matrix ``A = X X^T``. For a wide or
    square matrix these are exactly its ``mm``/``addmm`` calls (bitwise equal; a batch runs their
    ``bmm``/``baddbmm`` twins). A tall matrix runs the same polynomial from the right,
    ``X <- a X + X (b A + c A A)`` with ``A = X^T X``, instead of transposing in and out: the same
    math and flops, but a contiguous result, so slicing and scaling it are plain copies
    (docs/benchmarks.md). Its bits may differ from torch's within bf16 rounding. Where
    ``uses_gram`` says so, runs of iterations between restarts (``gram_segments``) are evaluated in
    the Gram form (``_gram_segment``). ``"aol"``: ``_aol``.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects [m, n] or [B, m, n] but got shape {tuple(x.shape)}")
    mm, addmm = (torch.mm, torch.addmm) if x.ndim == 2 else (torch.bmm, torch.baddbmm)
    y = x.to(config.dtype)
    tall = y.size(-2) > y.size(-1)
    if config.algorithm == "aol":
        return _aol(y, config, mm, addmm, tall)
    norm = y.norm(dim=(-2, -1), keepdim=True)
    if config.norm_scale != 1.0:
        norm = norm * config.norm_scale
    y = y.div(norm.clamp(min=config.eps))
    steps = range(len(config.coefficients))
    segments = gram_segments(config) if uses_gram(y.shape[-2:], config) else [range(i, i + 1) for i in steps]
    for segment in segments:
        triples = [config.coefficients[i] for i in segment]
        # A lone iteration costs the same either way; the standard step rounds less.
        step = _gram_segment if len(triples) > 1 else _standard_step
        y = step(y, triples, mm, addmm, tall)
    return y


def _aol(
    y: Tensor, config: NSConfig, mm: Callable[..., Tensor], addmm: Callable[..., Tensor], tall: bool
) -> Tensor:
    """AOL's scaling (``aol_scale``) for the Frobenius division; its scaled Gram matrix is step 1's
    ``A``, as in the source; the later steps are the standard iteration. Same products as
    ``"standard"`` with as many steps."""
    y, gram = aol_scale(y, config.eps, config.norm_scale, mm, tall)
    for k, triple in enumerate(config.coefficients):
        y = _standard_step(y, (triple,), mm, addmm, tall, gram if k == 0 else None)
    return y


def _standard_step(
    y: Tensor,
    triples: Sequence[Triple],
    mm: Callable[..., Tensor],
    addmm: Callable[..., Tensor],
    tall: bool,
    gram: Tensor | None = None,
) -> Tensor:
    """One iteration, torch's calls: ``a X + (b A + c A A) X`` (from the right when tall); ``gram``:
    ``A`` where the caller has it (AOL's first step)."""
    ((a, b, c),) = triples
    if gram is None:
        gram = mm(y.mT, y) if tall else mm(y, y.mT)
    poly = _small_poly(gram, b, c, addmm)
    return addmm(y, y, poly, beta=a) if tall else addmm(y, poly, y, beta=a)


def _small_poly(gram: Tensor, b: float, c: float, addmm: Callable[..., Tensor]) -> Tensor:
    """``b A + c A A``; a cubic step (``c == 0``, cubic5) skips the product: ``b A`` is what
    ``addmm`` gives there (the same bits), but torch 2.13's CPU ``baddbmm`` in bfloat16 with
    ``alpha=0`` returns ``A`` unscaled (beta ignored), which made batched cubic5 diverge."""
    return gram * b if c == 0.0 else addmm(gram, gram, gram, beta=b, alpha=c)


def _gram_segment(
    y: Tensor, triples: Sequence[Triple], mm: Callable[..., Tensor], addmm: Callable[..., Tensor], tall: bool
) -> Tensor:
    """``len(triples)`` iterations on ``y`` in the Gram form, for a wide ``y`` (a tall one mirrored).

    Every iterate is ``Q y`` with ``Q`` a polynomial in ``R = y y^T``, so the iteration can run on
    the small matrices alone: with ``Z = b R + c R R`` and ``P = a I + Z`` (the step's polynomial),
    ``Q <- P Q`` and ``R <- P R P``; ``y`` is multiplied once, at the end. Products are written as
    ``a M + Z M`` (one ``addmm``) so ``a`` is added in the product's accumulator, as the standard
    step adds ``a X``; only the segment's first ``Q = a I + Z`` is rounded on its diagonal.
    """
    r = mm(y.mT, y) if tall else mm(y, y.mT)
    q = r
    for k, (a, b, c) in enumerate(triples):
        z = _small_poly(r, b, c, addmm)
        if k == 0:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = addmm(q, q, z, beta=a) if tall else addmm(q, z, q, beta=a)
        if k + 1 < len(triples):  # the segment's last R is never read
            rz = addmm(r, z, r, beta=a)
            r = addmm(rz, rz, z, beta=a)
    return mm(y, q) if tall else mm(q, y)


def orthogonalize(matrices: Sequence[Tensor], config: NSConfig) -> list[Tensor]:
    """``newton_schulz`` of same-shape matrices, batched where batching pays.

    By default (``MUON_DTENSOR_NS_BATCH=auto``) they run as one batched product on CUDA and one at a
    time on CPU, which is faster with oneDNN's bfloat16 GEMMs (docs/benchmarks.md) and keeps a
    matrix's bits independent of its batch whatever the BLAS threads. ``always`` batches on CPU too,
    so CPU runs count the CUDA path's ops; ``never`` runs one at a time on CUDA too (``batching``).
    Batched, the bits are the same with one BLAS thread (tests/numerics/test_newton_schulz.py).
    """
    if not matrices:
        return []
    if len(matrices) == 1 or not batching(matrices[0].device.type):
        return [newton_schulz(m, config) for m in matrices]
    return list(newton_schulz(_batch(matrices), config).unbind(0))


def stacked(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` lie back to back in one storage, each contiguous (as a stack's
    ``unbind`` leaves them): one strided view can then cover them all."""
    first = tensors[0]
    size = first.numel() * first.element_size()
    return all(
        t.is_contiguous()
        and t.shape == first.shape
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and t.data_ptr() == first.data_ptr() + i * size
        for i, t in enumerate(tensors)
    )


def _batch(matrices: Sequence[Tensor]) -> Tensor:
    """Same-shape matrices as one ``[B, m, n]`` tensor: a view where they are a stack's (an owner
    assembles them so), else a stacked copy. Newton-Schulz never writes into its input."""
    first = matrices[0]
    if stacked(matrices):
        return first.as_strided((len(matrices), *first.shape), (first.numel(), *first.stride()))
    return torch.stack(list(matrices))


# Read at each call, so a process can switch between steps; checked at import too, so a bad value
# stops every rank before its first collective (a rank that owns no matrix never calls ``batching``).
BATCH_ENV = "MUON_DTENSOR_NS_BATCH"
BATCH_VALUES = ("auto", "always", "never")


def batching(device_type: str) -> bool:
    """Whether ``orthogonalize`` batches same-shape matrices on ``device_type``, per
    ``MUON_DTENSOR_NS_BATCH``: ``auto`` (the default, also when unset or empty): on every device
    but CPU; ``always``; ``never``. Any other value raises ``ValueError``."""
    value = os.environ.get(BATCH_ENV) or "auto"
    if value not in BATCH_VALUES:
        raise ValueError(
            f"{BATCH_ENV} must be one of {', '.join(BATCH_VALUES)} (unset means auto) but is "
            f"{value!r}; set one of those or unset it"
        )
    return value == "always" or (value == "auto" and device_type != "cpu")


batching("cpu")


def scalar_map(singular_values: Tensor, config: NSConfig) -> Tensor:
    """What the iteration does to each singular value (of the input divided by its Frobenius norm, or
    scaled by AOL), in the input's dtype: ``a s + b s^3 + c s^5`` composed once per step."""
    s = singular_values / config.norm_scale
    for a, b, c in config.coefficients:
        s = a * s + b * s**3 + c * s**5
    return s


def ns_flops(shape: Sequence[int], steps: int = 1) -> int:
    """Flops of ``steps`` standard iterations on one matrix: 4 m^2 n + 2 m^3 each, m <= n
    (A = X X^T costs 2 m^2 n, A A 2 m^3, the product with X 2 m^2 n)."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * n + 2 * m * m * m)


def orthogonalize_flops(shape: Sequence[int], config: NSConfig) -> int:
    """Flops of ``newton_schulz`` on one matrix of ``shape``: the standard iteration's, or the Gram
    form's where ``uses_gram``. What owner balancing and the cost model should count. AOL's are the
    standard count: its scaling's A = X X^T is step 1's, the rest is elementwise (uncounted)."""
    steps = len(config.coefficients)
    if uses_gram(shape, config):
        return _gram_flops(shape, gram_segments(config))
    return ns_flops(shape, steps)


def _gram_flops(shape: Sequence[int], segments: Sequence[range]) -> int:
    """Each segment of L iterations: R = X X^T and the closing Q X, 2 m^2 n each; Z = b R + c R R
    2 m^3 per iteration, Q <- a Q + Z Q 2 m^3 after the first, R <- P R P 4 m^3 before the last."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return sum(4 * m * m * n + (8 * len(seg) - 6) * m**3 for seg in segments)
