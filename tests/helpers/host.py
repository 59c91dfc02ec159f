"""Sizes that fit this host's CPU. bf16 products run at about 200 GFLOP/s on one thread of a CPU with
AVX512-BF16 or AMX and at about 1.3 where AVX2 emulates them (``muon_dtensor.demo.cpu``), so a bf16
check sized for one takes minutes on the other. A test that multiplies large bf16 matrices takes the
largest of its shapes that fits its budget at the measured rate, and names the shape in its id."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from muon_dtensor.demo.cpu import CpuProbe, probe


@functools.cache
def cpu() -> CpuProbe:
    """This host's one-thread bf16 and fp32 rates and its kind (MUON_DTENSOR_CPU_BF16 forces one),
    measured once per process: about 0.2 s."""
    return probe()


def largest_within(
    shapes: Sequence[tuple[int, int]], flops: Callable[[tuple[int, int]], float], seconds: float
) -> tuple[int, int]:
    """The first of ``shapes`` (largest first) whose bf16 ``flops`` take at most ``seconds`` here;
    the last (smallest) when none does."""
    rate = cpu().planning_bf16_gflops * 1e9
    return next((s for s in shapes if flops(s) <= seconds * rate), shapes[-1])


def shape_id(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))


def ns_dtype_here() -> torch.dtype:
    """The faster Newton-Schulz dtype here, as the demo picks it: the library's default bf16, or
    float32 where bf16 is emulated. For a test whose claim holds in either (bits against one
    process that runs the same dtype)."""
    return cpu().ns_dtype
