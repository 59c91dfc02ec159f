"""Update-scale modes beyond torch's two: ``adjust_lr_fn="spectral"`` and a number, the
update RMS to match, each checked against its formula on exactly orthogonal matrices, from the
global shape (a sharded step equals one process), with clear errors for bad values."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from muon_dtensor import Muon, split_params
from muon_dtensor.numerics.elementwise import adjust_lr
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, random_grads, step_together

SHAPES = [(64, 16), (16, 64), (32, 32), (48, 20)]


def orthogonal(shape: tuple[int, int]) -> torch.Tensor:
    """U V^T of a random matrix: every singular value exactly 1 (in float64)."""
    u, _, vh = torch.linalg.svd(torch.randn(*shape, dtype=torch.float64), full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("target", [0.2, 0.18, 1.0])
def test_a_number_is_the_update_rms(shape: tuple[int, int], target: float) -> None:
    update = adjust_lr(1.0, target, shape) * orthogonal(shape)
    assert update.pow(2).mean().sqrt().item() == pytest.approx(target, rel=1e-9)


@pytest.mark.parametrize("shape", SHAPES)
def test_spectral_is_sqrt_fan_out_over_fan_in(shape: tuple[int, int]) -> None:
    update = adjust_lr(1.0, "spectral", shape) * orthogonal(shape)
    spectral_norm = torch.linalg.matrix_norm(update, ord=2).item()
    assert spectral_norm == pytest.approx(math.sqrt(shape[0] / shape[1]), rel=1e-9)


def test_a_number_of_0_2_is_match_rms_adamw() -> None:
    for shape in SHAPES:
        assert adjust_lr(0.02, 0.2, shape) == adjust_lr(0.02, "match_rms_adamw", shape)


@pytest.mark.parametrize("bad", [0, -0.2, math.inf, math.nan, True, "rms", "Spectral"])
def test_bad_values_are_refused_with_the_fix(bad: Any) -> None:
    with pytest.raises(ValueError, match="adjust_lr_fn|Adjust learning rate function") as info:
        Muon([torch.nn.Parameter(torch.randn(4, 4))], adjust_lr_fn=bad)
    assert str(bad) in str(info.value)


def sharded_like_one_process(fn: str | float) -> list[int]:
    model, ref = build((2,)), build(None)
    opt = Muon(split_params(model), lr=0.02, adjust_lr_fn=fn)
    ref_opt = Muon(split_params(ref), lr=0.02, adjust_lr_fn=fn)
    params = [p for g in opt.param_groups for p in g["params"]]
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    shapes = [p.shape for p in ref_params]
    step_together([(params, opt), (ref_params, ref_opt)], lambda s: random_grads(shapes, 7 + s), range(3))
    return [i for i, (p, q) in enumerate(zip(params, ref_params)) if not torch.equal(full(p.detach()), q)]


@pytest.mark.parametrize("fn", ["spectral", 0.18])
def test_sharded_step_equals_one_process(fn: str | float) -> None:
    for bad in run_ranks(sharded_like_one_process, 2, fn, timeout=120):
        assert bad == []
