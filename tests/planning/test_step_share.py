"""``planning.step_share``: the optimizer's share of a step, from the cost model and from FLOPs."""

from __future__ import annotations

import pytest

from muon_dtensor.planning.costmodel import predict
from muon_dtensor.planning.hardware import Hardware
from muon_dtensor.planning.step_share import MODELS, StepShare, flop_share, step_share


def test_the_share_falls_as_tokens_per_step_grow() -> None:
    shapes, total = MODELS["llama3-8b"]
    shares = [step_share(shapes, total, 64, t) for t in (0.5e6, 1e6, 4e6)]
    assert shares[0].muon_share > shares[1].muon_share > shares[2].muon_share > 0
    assert all(s.muon_s == shares[0].muon_s for s in shares)  # the optimizer's time does not grow with T
    assert all(s.muon_share > s.adamw_share and s.step_ratio > 1 for s in shares)


def test_the_parts_are_the_stated_arithmetic() -> None:
    shapes, params, hw = [(256, 256), (1024, 256)], 1e6, Hardware.h200()
    got = step_share(shapes, params, 8, 4096, hw=hw, mfu=0.5, tensors=4)
    hidden = 256 * 256 + 1024 * 256
    assert got.train_s == pytest.approx(6 * params * 4096 / (8 * 989e12 * 0.5))
    assert got.adamw_s == pytest.approx(params / 8 * 28 / hw.memory_bandwidth + 8 * hw.op_overhead)
    rest = (params - hidden) / 8 * 28 / hw.memory_bandwidth
    assert got.muon_s == pytest.approx(predict(shapes, 8, hw, split=True).total + rest)
    share = StepShare(gpus=1, tokens=1.0, train_s=3.0, muon_s=1.0, adamw_s=0.5)
    assert (share.muon_share, share.adamw_share, share.step_ratio) == (0.25, 0.5 / 3.5, 4.0 / 3.5)


def test_flop_share_of_one_square_matrix_on_one_rank() -> None:
    # 5 standard iterations on n x n: A = X X^T, B = b A + c A A, B X: 3 products of 2 n^3 each
    n, tokens = 64, 1000
    ns = 5 * 3 * 2 * n**3
    assert flop_share([(n, n)], n * n, 1, tokens) == pytest.approx(ns / (ns + 6 * n * n * tokens))


def test_bad_input_names_the_parameter() -> None:
    shapes = [(256, 256)]
    with pytest.raises(ValueError, match="gpus should be a positive number but is 0"):
        step_share(shapes, 1e6, 0, 1e6)
    with pytest.raises(ValueError, match="tokens should be a positive number but is -1.0"):
        step_share(shapes, 1e6, 8, -1.0)
    with pytest.raises(ValueError, match="mfu should be in"):
        step_share(shapes, 1e6, 8, 1e6, mfu=1.5)
    with pytest.raises(ValueError, match="fewer than the hidden"):
        step_share(shapes, 10.0, 8, 1e6)
