"""Does this CPU multiply bfloat16 natively? A measured probe, shared by the demo and the benchmarks.

CPUs with AVX512-BF16 or AMX multiply bf16 matrices faster than fp32 (about 215 against 74 GFLOP/s
on one thread here); AVX2-only CPUs emulate bf16 about 50x slower than their fp32 (1.3 against
74 GFLOP/s), so a bf16 Newton-Schulz that takes a second on one takes minutes on the other.
``probe()`` times one bf16 and one fp32 ``torch.mm`` of a few hundred square on one thread (a
fraction of a second) and ``classify`` names the kind from the two rates.

The environment variable ``MUON_DTENSOR_CPU_BF16`` (``native`` or ``emulated``) forces the kind,
for tests and for trying the other path on any machine; the rates are still measured.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ENV", "EMULATED", "NATIVE", "CpuProbe", "classify", "host_cpu", "probe"]

ENV = "MUON_DTENSOR_CPU_BF16"
NATIVE, EMULATED = "native", "emulated"
# bf16 below this fraction of the fp32 rate is emulated: native CPUs measure about 3x fp32, emulating
# ones about 0.02x, so the line is far from both.
EMULATED_BELOW = 0.5
# Rates of bf16 against fp32 on one thread: emulated (AVX2-only) 1.3 / 74, native (AVX512-BF16) 215 / 74.
EMULATED_RATIO, NATIVE_RATIO = 1.3 / 74, 215 / 74
SIZE = 256  # square matrices: 34 MFLOP per product, 25 ms at the emulated 1.3 GFLOP/s


@dataclass(frozen=True)
class CpuProbe:
    """Measured one-thread GFLOP/s of a bf16 and an fp32 matrix product, and the kind they give."""

    bf16_gflops: float
    fp32_gflops: float
    kind: str  # NATIVE or EMULATED
    forced: bool = False  # the kind comes from MUON_DTENSOR_CPU_BF16, not from the rates

    @property
    def emulated(self) -> bool:
        return self.kind == EMULATED

    @property
    def ns_dtype(self) -> torch.dtype:
        """The faster Newton-Schulz dtype here: bf16 (the library's default) unless it is emulated."""
        return torch.float32 if self.emulated else torch.bfloat16

    @property
    def planning_bf16_gflops(self) -> float:
        """The bf16 rate to plan with: the measured one, or, where a forced kind contradicts it, the fp32
        rate times that kind's typical ratio (so forcing ``emulated`` on a native CPU plans as one)."""
        if classify(self.bf16_gflops, self.fp32_gflops) == self.kind:
            return self.bf16_gflops
        return self.fp32_gflops * (EMULATED_RATIO if self.emulated else NATIVE_RATIO)

    def describe(self) -> str:
        how = f"forced by {ENV}={self.kind}" if self.forced else "measured"
        return (
            f"CPU bf16 {self.kind} ({how}): one-thread {SIZE}x{SIZE} matrix products at "
            f"{self.bf16_gflops:.1f} GFLOP/s in bf16, {self.fp32_gflops:.1f} in fp32"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "bf16_gflops": round(self.bf16_gflops, 2),
            "fp32_gflops": round(self.fp32_gflops, 2),
            "kind": self.kind,
            "forced": self.forced,
        }


def classify(bf16_gflops: float, fp32_gflops: float) -> str:
    """``emulated`` when bf16 multiplies at less than half the fp32 rate, else ``native``."""
    return EMULATED if bf16_gflops < EMULATED_BELOW * fp32_gflops else NATIVE


def _gflops(dtype: torch.dtype, size: int, seconds: float) -> float:
    """Best one-thread rate of ``size``-square products over about ``seconds`` (at least 2 runs)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm up (oneDNN picks its kernel on the first call)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or spent < seconds:
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 2 * size**3 / best / 1e9


def probe(force: str | None = None, size: int = SIZE, seconds: float = 0.05) -> CpuProbe:
    """Measure bf16 and fp32 rates on one thread; the kind is ``force``, else $MUON_DTENSOR_CPU_BF16,
    else ``classify`` of the rates."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bf16, fp32 = _gflops(torch.bfloat16, size, seconds), _gflops(torch.float32, size, seconds)
    finally:
        torch.set_num_threads(threads)
    force = force or os.environ.get(ENV) or None
    if force not in (None, NATIVE, EMULATED):
        raise ValueError(f"{ENV} should be {NATIVE!r} or {EMULATED!r} but is {force!r}")
    return CpuProbe(bf16, fp32, force or classify(bf16, fp32), forced=force is not None)


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, set[str]]:
    """The CPU's name, with its family and model where /proc/cpuinfo gives them (a virtual machine's
    name may say only "AMD EPYC": family 25 model 1 is a Zen 3, model 17 a Zen 4), and its flags
    (``avx512_bf16``, ``amx_bf16``: native bf16); the platform's name and no flags without the file."""
    name, flags = platform.processor() or platform.machine(), set()
    ids: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                name = value
            elif key in ("cpu family", "model"):
                ids[key] = value
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    if ids:
        name += " (" + ", ".join(f"{k} {v}" for k, v in ids.items()) + ")"
    return name, flags
