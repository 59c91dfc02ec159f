"""AOL preconditioning (``ns_algorithm="aol"``) and the turbo_muon preset against their source's code.

The source is thib-s/flash-newton-schulz at commit cdb03db0e6c59e82365426373a1601fadfdf7ab3:
https://github.com/thib-s/flash-newton-schulz/blob/cdb03db0e6c59e82365426373a1601fadfdf7ab3/newton_schulz_triton.py
``newton_schulz_triton_aol`` (L548-599) is a Triton kernel chain that cannot run on CPU:
``_triton_aol`` below transcribes it line by line with its kernels replaced by what their docstrings
say they compute (``ns_line_1`` L147-183: ``A @ A.T``; ``ns_line_2`` L274-315: ``alpha A A^T + beta A``;
``ns_line_3`` L432-473: ``a X + B X``), in a chosen dtype where the source casts to bfloat16 (L560).
``_hp_opt_orthogonalize`` transcribes the repository's pure-torch AOL iteration,
``hp-opt-aol-poly.py`` L317-352 (``orthogonalize(G, ns_consts, aol=True)``), which the author used
to plot the coefficients' effect. Measured differences are in docs/benchmarks.md ("AOL").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard

from muon_dtensor import Muon
from muon_dtensor.numerics.aol import aol_scale
from muon_dtensor.numerics.newton_schulz import (
    BAND_INPUT_FLOOR,
    PRESET_BANDS,
    PRESET_STEPS,
    PRESETS,
    NSConfig,
    newton_schulz,
    ns_flops,
    orthogonalize_flops,
    scalar_map,
)
from muon_dtensor.numerics.ns_config import resolve_ns_config
from tests.harness.ranks import run_ranks
from tests.helpers.bits import assert_batch_mates_do_not_matter
from tests.helpers.models import full, stepped
from tests.numerics.test_ns_presets import seeded_inputs

Triple = tuple[float, float, float]
DEFAULT = (3.4445, -4.775, 2.0315)

# newton_schulz_triton.py@cdb03db L554-559, as the source writes it.
SOURCE_CONSTS: list[list[float]] = [
    [4.6051, -9.6552, 5.6769],
    [4.7505, -6.0861, 2.1790],
    [2.7763, -2.3190, 0.5523],
    [2.4231, -2.2861, 0.8193],
]


def _triton_aol(G: Tensor, dtype: torch.dtype, epsilon: float = 1e-7) -> Tensor:
    """newton_schulz_triton.py@cdb03db L549-599 in ``dtype`` (the source: bfloat16)."""
    X = G.to(dtype=dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X.contiguous()
    A = X @ X.mT  # L578 ns_line_1
    s = torch.rsqrt(torch.clamp_min(A.abs().sum(dim=-1, keepdim=False), min=epsilon))  # L579-581
    X = X * s.unsqueeze(-1)  # L582
    a, b, c = SOURCE_CONSTS[0]  # L584
    A = A * s.unsqueeze(-1) * s.unsqueeze(-2)  # L585
    B = c * (A @ A.mT) + b * A  # L586 ns_line_2(A, alpha=c, beta=b)
    X = a * X + B @ X  # L587 ns_line_3(B, X, a)
    for a, b, c in SOURCE_CONSTS[1:]:  # L591-595
        A = X @ X.mT
        B = c * (A @ A.mT) + b * A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):  # L597-598
        X = X.mT
    return X


def _hp_opt_orthogonalize(G: Tensor, ns_consts: list[list[float]]) -> Tensor:
    """hp-opt-aol-poly.py@cdb03db L317-352 with ``aol=True``, in ``G``'s dtype."""
    X = G
    if G.size(-2) > G.size(-1):
        X = X.mT
    for i, (a, b, c) in enumerate(ns_consts):
        A = X @ X.mT
        if i == 0:
            rescalings = torch.clamp(A.abs().sum(dim=-1, keepdim=True), min=1e-12)
            inv_sqrt = torch.rsqrt(rescalings)
            X = X * inv_sqrt
            A = (A * inv_sqrt) * inv_sqrt.transpose(-2, -1)
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def _aol(dtype: torch.dtype, preset: str = "turbo_muon", steps: int | None = None) -> NSConfig:
    """``Muon(ns_coefficients=preset, ns_algorithm="aol")``'s config, in any dtype (float64 too)."""
    steps = PRESET_STEPS[preset] if steps is None else steps
    return dataclasses.replace(resolve_ns_config(preset, steps, 1e-7, torch.float32, "aol"), dtype=dtype)


def source_differences(dtype: torch.dtype) -> dict[str, float]:
    """Largest |ours - source's| per seeded input (``tests.numerics.test_ns_presets.seeded_inputs``) in
    ``dtype``, against the Triton transcription; float64 against the hp-opt one too."""
    out = {}
    for x in seeded_inputs():
        ours = newton_schulz(x, _aol(dtype)).double()
        name = "x".join(map(str, x.shape))
        out[name] = float((ours - _triton_aol(x, dtype).double()).abs().max())
        if dtype == torch.float64:
            out[f"{name}/hp-opt"] = float((ours - _hp_opt_orthogonalize(x, SOURCE_CONSTS)).abs().max())
    return out


# ------------------------------------------------------------------------------ against source
def test_preset_is_the_sources_table() -> None:
    triples, norm_scale = PRESETS["turbo_muon"]
    assert triples == tuple(tuple(t) for t in SOURCE_CONSTS) and norm_scale == 1.0
    assert PRESET_STEPS["turbo_muon"] == len(SOURCE_CONSTS) == 4


def test_matches_the_sources_iteration_in_float64() -> None:
    """Measured (torch 2.13, AMD EPYC): at most 3.7e-15 against either transcription (1.7e-15 to
    3.7e-15 per input; tall ones run from the right here, transposed there)."""
    differences = source_differences(torch.float64)
    assert len(differences) == 2 * len(seeded_inputs())
    assert max(differences.values()) <= 1e-12, differences


def test_matches_the_sources_iteration_in_bfloat16() -> None:
    """bfloat16 rounds differently where the source's kernels fuse (``b A`` and ``a X`` added in the
    float32 accumulator here, rounded first in the transcription, and the scale rounded once from
    float32 here): measured 0.0088 to 0.026 per input (largest entries 0.22 to 0.44); relative in
    Frobenius norm 0.019 to 0.067, where ours is 0.007 to 0.066 from float64 and the transcription
    0.018 to 0.090 (its every op rounded, where the source's kernels accumulate in float32)."""
    differences = source_differences(torch.bfloat16)
    assert max(differences.values()) <= 0.05, differences


# ------------------------------------------------------------------------------------ the maths
def test_scaled_spectral_norm_is_at_most_one_and_the_first_gram_is_reused() -> None:
    """AOL bounds the spectral norm by 1 (by 1/1.02 under Polar Express's margin); the returned
    Gram matrix is the scaled matrix's own, so step 1 needs no product of its own."""
    for x in seeded_inputs():
        tall = x.size(-2) > x.size(-1)
        for norm_scale in (1.0, 1.02):
            y, gram = aol_scale(x, 1e-7, norm_scale, torch.mm, tall)
            assert torch.linalg.matrix_norm(y, ord=2) <= 1.0 / norm_scale + 1e-12
            torch.testing.assert_close(gram, y.mT @ y if tall else y @ y.mT, rtol=0, atol=1e-13)


@pytest.mark.parametrize("preset", ["turbo_muon", "keller", "polar_express"])
def test_singular_values_are_the_polynomial_of_the_scaled_ones(preset: str) -> None:
    """In float64 the output's singular values are ``scalar_map`` of AOL's scaled input's, and those
    at least BAND_INPUT_FLOOR land in the preset's band: AOL changes only the input scaling, so every
    preset's band holds under it."""
    config = _aol(torch.float64, preset)
    lo, hi = PRESET_BANDS[preset]
    for x in seeded_inputs():
        y, _ = aol_scale(x, 1e-7, config.norm_scale, torch.mm, x.size(-2) > x.size(-1))
        s_in = torch.linalg.svdvals(y) * config.norm_scale  # scalar_map divides by it again
        expected = scalar_map(s_in, config).sort(descending=True).values
        s_out = torch.linalg.svdvals(newton_schulz(x, config))
        torch.testing.assert_close(s_out, expected, rtol=0, atol=1e-10)
        converged = scalar_map(s_in[s_in >= BAND_INPUT_FLOOR], config)
        assert len(converged) > 0 and lo - 1e-9 <= converged.min() and converged.max() <= hi + 1e-9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_turbo_muon_in_low_precision_stays_near_its_band(dtype: torch.dtype) -> None:
    """Measured on the seeded inputs: converged singular values within 0.02 (bfloat16) of the band."""
    lo, hi = PRESET_BANDS["turbo_muon"]
    slack = 0.02 if dtype == torch.bfloat16 else 2e-3
    for x in seeded_inputs():
        y, _ = aol_scale(x, 1e-7, 1.0, torch.mm, x.size(-2) > x.size(-1))
        converged = int((torch.linalg.svdvals(y) >= BAND_INPUT_FLOOR).sum())
        s_out = torch.linalg.svdvals(newton_schulz(x.float(), _aol(dtype)).double())
        assert int(((s_out >= lo - slack) & (s_out <= hi + slack)).sum()) >= converged > 0
        assert s_out.max() <= hi + slack


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (33, 33)])
def test_result_of_a_matrix_does_not_depend_on_its_batch(
    dtype: torch.dtype, shape: tuple, one_thread: None
) -> None:
    """AOL's row sums are per matrix: a matrix's bits ignore its batch-mates (one BLAS thread),
    batched against batched (tests/helpers/bits.py)."""
    config = _aol(dtype)
    x = torch.randn(7, *shape, generator=torch.Generator().manual_seed(2))
    assert_batch_mates_do_not_matter(x, lambda b: newton_schulz(b, config))


def test_zero_input_gives_zero_and_flops_are_the_standard_count() -> None:
    config = _aol(torch.bfloat16)
    assert torch.equal(
        newton_schulz(torch.zeros(2, 8, 16), config), torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    )
    for shape in [(256, 256), (512, 1024), (1024, 256)]:
        assert orthogonalize_flops(shape, config) == ns_flops(shape, 4) == 0.8 * ns_flops(shape, 5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tall", [False, True])
def test_an_overflowed_gram_or_a_zero_row_under_eps_0_gives_a_finite_update(
    dtype: torch.dtype, tall: bool
) -> None:
    """Before, both were NaN (0 * inf, inf * 0). A Gram matrix beyond float32's range gives zero, as
    the Frobenius division by its infinite norm does; a zero row under eps=0 stays zero and the other
    rows are the bits of eps=1e-7 (whose clamp they never reach). Bits are compared only between
    batches of one shape (CONTRIBUTING.md, "Bits and tolerances")."""
    config = _aol(dtype)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    x[1, 3] = 0.0
    x = x.mT if tall else x
    standard = resolve_ns_config(DEFAULT, 5, 1e-7, dtype)
    huge = torch.stack([x[0] * 1e20, x[0]])  # the first matrix's Gram overflows, the second's not
    out = newton_schulz(huge, config)
    assert torch.equal(out[0], newton_schulz(huge[0], standard)) and not out[0].any()
    # The second matrix against itself in a batch of the same shape: the same kernels, so the same
    # bits on every CPU (alone, an unbatched matmul may take another kernel: 1.5840e-04 vs 1.5825e-04
    # on Zen 5).
    assert torch.equal(out[1], newton_schulz(torch.stack([x[0], x[0]]), config)[1])
    at_zero = newton_schulz(x, dataclasses.replace(config, eps=0.0))
    assert at_zero.isfinite().all() and torch.equal(at_zero, newton_schulz(x, config))


# ----------------------------------------------------------------------------------- the options
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_turbo_muon_without_aol_is_refused(algorithm: Any) -> None:
    with pytest.raises(
        ValueError, match=f"'turbo_muon' is fitted to inputs scaled by AOL, but ns_algorithm is '{algorithm}'"
    ):
        Muon([nn.Parameter(torch.ones(4, 8))], ns_coefficients="turbo_muon", ns_algorithm=algorithm)
    with pytest.raises(ValueError, match="pass ns_algorithm='aol' with it"):
        Muon([{"params": [nn.Parameter(torch.ones(4, 8))], "ns_coefficients": "turbo_muon"}])
    table = [(a, b, c) for a, b, c in SOURCE_CONSTS]  # its triples by value: the plain iteration, allowed
    Muon([nn.Parameter(torch.ones(4, 8))], ns_coefficients=table, ns_steps=4, ns_algorithm=algorithm)


def test_a_muon_step_runs_turbo_muon() -> None:
    """``Muon(ns_coefficients="turbo_muon", ns_algorithm="aol", ns_steps=4)``: the update is the
    orthogonalized momentum of the first step, scaled as every Muon step."""
    gen = torch.Generator().manual_seed(4)
    start, grad = torch.randn(32, 48, generator=gen), torch.randn(32, 48, generator=gen)
    p = nn.Parameter(start.clone())
    opt = Muon([p], lr=0.1, weight_decay=0.0, nesterov=False, momentum=0.0, ns_coefficients="turbo_muon",
               ns_algorithm="aol", ns_steps=4)  # fmt: skip
    p.grad = grad.clone()
    opt.step()
    assert torch.equal(p.detach(), start - 0.1 * newton_schulz(grad, _aol(torch.bfloat16)).float())


# ------------------------------------------------------------------------------- sharded == one
# Two same-shape wide matrices (owners batch them), tall, 37 rows (uneven over 2 ranks on Shard(0)),
# 31 columns (uneven on Shard(1)), fewer rows than ranks.
SHAPES = [(24, 80), (24, 80), (80, 24), (37, 24), (24, 31), (3, 16)]


def _run(mesh_shape: tuple[int, ...] | None, placements: tuple, **kwargs: Any) -> list[Tensor]:
    params, _ = stepped(SHAPES, mesh_shape, lambda i: placements, 2, lambda ps: Muon(ps, lr=0.02, **kwargs))
    return [full(p.detach()) for p in params]


def aol_exactness() -> dict[str, list[int]]:
    """Rank function: per layout, mode and dtype, the parameters that differ bitwise from the
    one-process turbo_muon step; and those that differ from the standard step (all should)."""
    n = dist.get_world_size()
    turbo: dict[str, Any] = {"ns_coefficients": "turbo_muon", "ns_algorithm": "aol", "ns_steps": 4}
    layouts = {"fsdp": (Shard(0),), "fsdp_dim1": (Shard(1),), "replicated": (Replicate(),)}
    modes: dict[str, dict[str, Any]] = {
        "owner": {},
        "gather": {"mode": "gather"},
        "rounds": {"max_round_bytes": 4000},
    }
    out: dict[str, list[int]] = {}
    for dtype in (torch.bfloat16, torch.float32):
        reference = _run(None, (), ns_dtype=dtype, **turbo)
        standard = _run(None, (), ns_dtype=dtype)
        out[f"same_as_standard/{dtype}"] = [
            i for i, (a, b) in enumerate(zip(reference, standard)) if torch.equal(a, b)
        ]
        for name, placements in layouts.items():
            for mode, extra in modes.items():
                got = _run((n,), placements, ns_dtype=dtype, **turbo, **extra)
                out[f"{name}/{mode}/{dtype}"] = [
                    i for i, (a, b) in enumerate(zip(got, reference)) if not torch.equal(a, b)
                ]
    return out


def test_aol_sharded_step_equals_one_process_bitwise() -> None:
    results = run_ranks(aol_exactness, 2, timeout=180)
    for rank, result in enumerate(results):
        for key, differ in result.items():
            assert differ == [], f"rank {rank} {key}: parameters {differ}"
    assert len(results[0]) == 2 * (1 + 3 * 3)
