"""A multi-tensor op on CPU takes its Python scalar as a 0-dim tensor of the list's dtype
(``cpu_scalars.scalar_of``): four times cheaper per small tensor, and it must not change a bit. The
kernel rounds a Python scalar to a float32 list's dtype before it multiplies; these tests hold the
tensor scalar to the per-tensor single op, over values of every magnitude, both zeros and a
subnormal, and check that the lists it must not touch (bf16, mixed dtypes) keep the float."""

from __future__ import annotations

import math

import pytest
import torch

from muon_dtensor.base.torch_ops import foreach_mul
from muon_dtensor.numerics.cpu_scalars import scalar_of, scalars_of
from muon_dtensor.numerics.elementwise import _mul_, empty_like_all

VALUES = [0.95, 1 - 0.95, 1 - 0.02 * 0.1, 0.1 / 3, 3.0**0.5, -0.0, 0.0, 1e-30, 1e-45, 3.0e38, -7.25]


def _tensors(dtype: torch.dtype, seed: int, n: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = [10.0**k for k in (-20, -3, 0, 2, 15, 30)]
    return [
        (torch.randn(7, 5, generator=gen, dtype=torch.float64) * scales[i % 6]).to(dtype) for i in range(n)
    ]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return all(torch.equal(x.view(ints[x.dtype]), y.view(ints[y.dtype])) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tensor_scalar_multiplies_as_the_python_scalar(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    values = VALUES + [torch.rand((), generator=gen).item() * 10.0 ** (k - 9) for k in range(12)]
    for v in values:
        got, want = _tensors(dtype, 1), _tensors(dtype, 1)
        assert isinstance(scalar_of(got, v), torch.Tensor)
        _mul_(got, v)
        for t in want:
            t.mul_(v)
        assert _same_bits(got, want), v
        fresh = list(foreach_mul(_tensors(dtype, 2), scalar_of(got, v)))
        assert _same_bits(fresh, [t.mul(v) for t in _tensors(dtype, 2)]), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_per_tensor_scalars_multiply_as_the_python_scalars(dtype: torch.dtype) -> None:
    for values in ([0.3] * 6, [0.3, 0.3, 0.7, 0.3, 1.5, 0.7], [0.3, 0.0, 0.3, -0.0, 0.3, 0.3]):
        got, want = _tensors(dtype, 3), _tensors(dtype, 3)
        _mul_(got, values)
        for t, v in zip(want, values):
            t.mul_(v)
        assert _same_bits(got, want), values
    one = _tensors(dtype, 4)
    assert isinstance(scalars_of(one, [0.3] * 6), torch.Tensor)  # all equal: one scalar
    assert scalars_of(one, [0.3, 0.7] * 3) == [0.3, 0.7] * 3
    assert scalars_of(one, [0.0, -0.0] * 3) == [0.0, -0.0] * 3  # equal, but each zero keeps its sign


def test_only_cpu_lists_of_one_wide_dtype_take_a_tensor() -> None:
    wide = _tensors(torch.float32, 5)
    assert scalar_of([t.bfloat16() for t in wide], 0.5) == 0.5  # bf16: the per-tensor path rounds itself
    assert scalar_of([wide[0], wide[1].double()], 0.5) == 0.5  # mixed: a float32 scalar would round fp64
    assert scalar_of([], 0.5) == 0.5
    negative_zero = scalar_of(wide, -0.0)
    assert isinstance(negative_zero, torch.Tensor) and math.copysign(1.0, negative_zero.item()) == -1.0
    third = scalar_of(wide, 1 / 3)
    assert isinstance(third, torch.Tensor) and third.item() == torch.tensor(1 / 3, dtype=torch.float32).item()
    assert scalar_of(wide, 0.25) is scalar_of(wide, 0.7)  # made once; a new value is written into it


@pytest.mark.slow  # the profiler's first start in a process takes seconds
def test_a_changing_scalar_adds_no_host_op() -> None:
    """An lr schedule or AdamW's bias correction changes the value every step: written into a tensor
    made once, it adds no torch op (the host-op counts of bench_host.py must not grow)."""
    from torch.profiler import ProfilerActivity, profile

    tensors = _tensors(torch.float32, 6)
    _mul_(tensors, 0.5)  # the thread's scalar is made here, once
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for v in (0.25, 0.125, 0.7):
            _mul_(tensors, v)
            _mul_(tensors, [v] * len(tensors))
    top = [e.name for e in prof.profiler.function_events if e.cpu_parent is None]
    assert top == ["aten::_foreach_mul_"] * 6


def test_empty_like_all_stacks_each_trailing_shape_in_list_order() -> None:
    shapes = [(2, 3), (4, 5), (1, 3), (2, 3), (3,), (6, 5)]
    tensors = [torch.zeros(s) for s in shapes] + [torch.zeros(2, 3, dtype=torch.float64)]
    out = empty_like_all(tensors)
    assert [tuple(t.shape) for t in out] == [*shapes, (2, 3)]
    assert [t.dtype for t in out] == [t.dtype for t in tensors]
    threes = [out[i] for i in (0, 2, 3)]  # one allocation, in list order, back to back
    assert len({t.untyped_storage().data_ptr() for t in threes}) == 1
    assert [t.data_ptr() for t in threes] == sorted(t.data_ptr() for t in threes)
    assert out[1].untyped_storage().data_ptr() == out[5].untyped_storage().data_ptr()
    assert out[6].untyped_storage().data_ptr() != out[0].untyped_storage().data_ptr()


def test_each_thread_writes_its_own_scalar() -> None:
    """Ops release the GIL while they run: a scalar shared between threads could change under one."""
    import threading

    wide = _tensors(torch.float32, 7)
    mine = scalar_of(wide, 0.5)
    theirs: list[object] = []
    worker = threading.Thread(target=lambda: theirs.append(scalar_of(wide, 0.25)))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and isinstance(mine, torch.Tensor) and mine.item() == 0.5
