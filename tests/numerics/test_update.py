"""The multi-tensor update ops: the same bits as the per-tensor single ops, and a shard's result equal
to the same rows of the full tensor's result (the property exactness rests on)."""

from __future__ import annotations

import pytest
import torch

import muon_dtensor.numerics.elementwise as elementwise
from muon_dtensor.numerics.elementwise import apply_muon_update, buckets, muon_momentum, scale_updates

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
    got = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
    muon_momentum(bufs, grads, got, 0.95, nesterov)
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
    scaled = [torch.empty(s, dtype=dtype) for s in SHAPES]
    scale_updates(outs, scaled, lrs)
    apply_muon_update(params, scaled, lr=0.02, weight_decay=0.1)
    for p, o, lr in zip(ref, outs, lrs):
        p.mul_(1 - 0.02 * 0.1).sub_(o.to(dtype).mul_(lr))
    assert all(torch.equal(a, b) for a, b in zip(params, ref))


def _step(grad: torch.Tensor, buf: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    ns_in = torch.empty(buf.shape, dtype=torch.bfloat16)
    muon_momentum([buf], [grad], [ns_in], 0.95, True)
    scaled = torch.empty(param.shape, dtype=param.dtype)
    scale_updates([ns_in], [scaled], [0.3])
    apply_muon_update([param], [scaled], lr=0.02, weight_decay=0.1)
    return ns_in


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_a_shard_equal_rows_of_the_full_result(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    grad, buf, param = (torch.randn(101, 37, generator=gen).to(dtype) for _ in range(3))
    full_buf, full_param = buf.clone(), param.clone()
    full_in = _step(grad, full_buf, full_param)
    for start, stop in [(0, 50), (50, 101), (7, 8), (13, 77)]:
        b, p = buf[start:stop].clone(), param[start:stop].clone()
        ns_in = _step(grad[start:stop], b, p)
        assert torch.equal(ns_in, full_in[start:stop]) and torch.equal(b, full_buf[start:stop])
        assert torch.equal(p, full_param[start:stop])


def test_cpu_pieces_cover_every_element_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache-sized pieces: every element of every tensor in exactly one piece, aligned across groups."""
    monkeypatch.setattr(elementwise, "CPU_PIECE_ELEMENTS", 100)
    a = [torch.zeros(s) for s in [(30, 7), (5, 5), (0, 0), (401,)]] + [torch.zeros(8, 40).mT]
    b = [torch.zeros_like(t) for t in a]
    for index, (pa, pb) in buckets([a, b]):
        assert sum(t.numel() for t in pa) <= 100 or len(pa) == 1
        for i, x, y in zip(index, pa, pb):
            assert x.shape == y.shape and x.numel() <= max(
                100, a[i].numel() if not a[i].is_contiguous() else 0
            )
            x.add_(1)
            y.add_(2)
    assert all(bool((t == 1).all()) for t in a) and all(bool((t == 2).all()) for t in b)


def _buckets_one_by_one(
    groups: list[list[torch.Tensor]], limit: int
) -> list[tuple[list[int], list[list[int]]]]:
    """The bucketing rule, tensor by tensor, for tensors that are never cut: a bucket closes
    before the tensor that would take it over ``limit`` elements."""
    out: list[tuple[list[int], list[list[int]]]] = []
    index: list[int] = []
    size = 0
    for i, t in enumerate(groups[0]):
        if size and size + t.numel() > limit:
            out.append((index, [[id(g[j]) for j in index] for g in groups]))
            index, size = [], 0
        index.append(i)
        size += t.numel()
    out.append((index, [[id(g[j]) for j in index] for g in groups]))
    return out


def test_buckets_of_uncut_tensors_are_runs_of_the_same_tensors_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The steady step's buckets over thousands of small tensors are list slices (``_runs``), no
    longer built tensor by tensor: the same buckets, the same tensors, in order."""
    monkeypatch.setattr(elementwise, "CPU_PIECE_ELEMENTS", 100)
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(0, 101, (200,), generator=gen)] + [100, 100, 0, 1]
    a = [torch.zeros(n) for n in sizes]
    b = [torch.zeros(n) for n in sizes]
    got = [(index, [[id(t) for t in g] for g in pieces]) for index, pieces in buckets([a, b])]
    assert got == _buckets_one_by_one([a, b], 100)
    assert len(got) > 50  # many buckets: the rule was exercised


def test_mixed_dtype_lists_cast_each_tensor_to_its_own_dtype() -> None:
    """One bucket may hold fp32 and bf16 parameters; each result lands in its own dtype."""
    outs = [t.to(torch.bfloat16) for t in _tensors(torch.float32, 5)]
    dtypes = [torch.float32, torch.bfloat16] * 3
    scaled = [torch.empty(o.shape, dtype=d) for o, d in zip(outs, dtypes)]
    scale_updates(outs, scaled, [0.5] * len(outs))
    for o, d, got in zip(outs, dtypes, scaled):
        assert got.dtype == d and torch.equal(got, o.to(d).mul_(0.5))
    grads = [g.to(d) for g, d in zip(_tensors(torch.float32, 6), dtypes)]
    bufs = [b.to(d) for b, d in zip(_tensors(torch.float32, 7), dtypes)]
    ref = [b.clone() for b in bufs]
    nesterov = [torch.empty(b.shape, dtype=torch.bfloat16) for b in bufs]
    muon_momentum(bufs, grads, nesterov, 0.95, True)
    assert all(torch.equal(a, _reference_momentum(b, g, True)) for a, b, g in zip(nesterov, ref, grads))
