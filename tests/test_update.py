"""The multi-tensor update ops: the same bits as the per-tensor single ops, and a shard's result equal
to the same rows of the full tensor's result (the property exactness rests on)."""

from __future__ import annotations

import pytest
import torch

from muon_dtensor.update import apply_muon_update, muon_momentum, scale_updates

SHAPES = [(37, 53), (64, 64), (3, 1), (0, 0), (1000, 17)]


def _tensors(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _reference_momentum(buf: torch.Tensor, grad: torch.Tensor, nesterov: bool) -> torch.Tensor:
    scaled = grad.mul(1 - 0.95)
    buf.mul_(0.95).add_(scaled)
    return torch.add(scaled, buf.mul(0.95)).to(torch.bfloat16) if nesterov else buf.to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_equals_per_tensor_ops(dtype: torch.dtype, nesterov: bool) -> None:
    grads, bufs = _tensors(dtype, 0), _tensors(dtype, 1)
    ref_bufs = [b.clone() for b in bufs]
    got = muon_momentum(bufs, grads, 0.95, nesterov, torch.bfloat16)
    want = [_reference_momentum(b, g, nesterov) for b, g in zip(ref_bufs, grads)]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(bufs, ref_bufs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_equals_per_tensor_ops(dtype: torch.dtype) -> None:
    """bf16 params: weight decay 1 - 0.02 * 0.1 = 0.998 must multiply as ``Tensor.mul_`` does, not as
    torch's CPU ``_foreach_mul_``, which rounds it to bf16 (0.996) first."""
    params, outs = _tensors(dtype, 2), _tensors(torch.bfloat16, 3)
    lrs = [0.02 * (i + 1) for i in range(len(outs))]
    ref = [p.clone() for p in params]
    apply_muon_update(params, scale_updates(outs, dtype, lrs), lr=0.02, weight_decay=0.1)
    for p, o, lr in zip(ref, outs, lrs):
        p.mul_(1 - 0.02 * 0.1).sub_(o.to(dtype).mul_(lr))
    assert all(torch.equal(a, b) for a, b in zip(params, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_shard_equal_rows_of_the_full_result(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    grad, buf, param = (torch.randn(101, 37, generator=gen).to(dtype) for _ in range(3))
    full_buf, full_param = buf.clone(), param.clone()
    full_in = muon_momentum([full_buf], [grad], 0.95, True, torch.bfloat16)[0]
    apply_muon_update([full_param], scale_updates([full_in], dtype, [0.3]), lr=0.02, weight_decay=0.1)
    for start, stop in [(0, 50), (50, 101), (7, 8), (13, 77)]:
        b, p = buf[start:stop].clone(), param[start:stop].clone()
        ns_in = muon_momentum([b], [grad[start:stop]], 0.95, True, torch.bfloat16)[0]
        apply_muon_update([p], scale_updates([ns_in], dtype, [0.3]), lr=0.02, weight_decay=0.1)
        assert torch.equal(ns_in, full_in[start:stop]) and torch.equal(b, full_buf[start:stop])
        assert torch.equal(p, full_param[start:stop])
