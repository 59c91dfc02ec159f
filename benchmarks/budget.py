"""Pick a matrix-set size for ``bench_step.py`` that finishes within its time budget on this CPU.

Almost all of a step is bf16 Newton-Schulz, whose cost is its matrix products: 5 iterations of
``A = X X^T`` (2 m^2 n), ``B = b A + c A A`` (2 m^3) and ``B X`` (2 m^2 n) for an m x n matrix,
m <= n. The run's time is that, times the steps every contender takes, at the bf16 rate
``muon_dtensor.demo.cpu.probe`` measures on one thread. Native-bf16 CPUs (AVX512-BF16/AMX) fit the
default 8 x 512 set in about 1.5 minutes and keep it, so their results stay comparable; CPUs that
emulate bf16 (about 50x slower) get the largest smaller set in ``CANDIDATES`` that fits.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from muon_dtensor.demo.cpu import CpuProbe, probe
from muon_dtensor.planning.costmodel import transformer_shapes

NS_ITERATIONS = 5
OVERHEAD = 1.3  # measured total / Newton-Schulz estimate of the default set here (90 s / 70 s)
USABLE = 0.5  # plan for half the budget: rank start-up, load from other processes, rate noise
DEFAULT = (8, 512)
# (layers, width), largest first: each does less Newton-Schulz work than the one before.
CANDIDATES = [DEFAULT, (8, 384), (8, 256), (4, 256), (8, 128), (4, 128), (2, 128), (2, 64), (1, 64)]


def ns_flops(shapes: list[tuple[int, int]]) -> float:
    """Floating-point operations of one Newton-Schulz orthogonalization of every matrix."""
    total = 0.0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += NS_ITERATIONS * (4 * m * m * n + 2 * m**3)
    return total


def step_equivalents(args: argparse.Namespace, world_sizes: list[int], cores: int) -> float:
    """Whole-set Newton-Schulz passes the slowest process makes: 2 one-process contenders; at each N,
    torch.optim.Muon on DTensors and gather mode (the whole set on every rank) and owner (1/N of it),
    time-shared when ranks outnumber cores."""
    per_contender = args.warmup + args.steps
    total = 2.0 * per_contender
    for n in world_sizes:
        total += per_contender * (2 + 1 / n) * max(1.0, n / cores)
    return total


def estimate_s(shapes: list[tuple[int, int]], passes: float, gflops: float) -> float:
    """Seconds the run should take at ``gflops`` bf16 on one thread."""
    return OVERHEAD * ns_flops(shapes) * passes / (gflops * 1e9)


@dataclass(frozen=True)
class SizeChoice:
    layers: int
    width: int
    estimate_s: float
    reason: str


def choose_size(passes: float, cpu: CpuProbe, budget_s: float) -> SizeChoice:
    """The first of ``CANDIDATES`` whose estimate fits ``USABLE`` of ``budget_s`` (the smallest if none)."""
    gflops, limit = cpu.planning_bf16_gflops, USABLE * budget_s
    default_s = estimate_s(transformer_shapes(*DEFAULT), passes, gflops)
    for layers, width in CANDIDATES:
        est = estimate_s(transformer_shapes(layers, width), passes, gflops)
        if est <= limit:
            break
    rate = f"{gflops:.1f} GFLOP/s bf16 ({cpu.kind})"
    if (layers, width) == DEFAULT:
        reason = f"the default set, estimated {est:.0f} s at {rate}, fits {limit:.0f} s (half the budget)"
    else:
        reason = (
            f"the default 8 x 512 set would take about {default_s:.0f} s at {rate}, over {limit:.0f} s "
            f"(half the {budget_s:.0f} s budget); {layers} x {width} is the largest set that fits"
            f" (estimated {est:.0f} s). Its times are not comparable with the 8 x 512 results"
        )
        if est > limit:
            reason = reason.replace(
                "is the largest set that fits", "is the smallest set, and even it does not fit"
            )
    return SizeChoice(layers, width, est, reason)


def fit_budget(args: argparse.Namespace, world_sizes: list[int]) -> dict[str, Any]:
    """Probe the CPU's bf16 and fp32 rates; where --layers and --width are not given, set them to the
    largest set whose estimated run fits --budget (8 x 512 on native-bf16 CPUs). Prints the choice."""
    from benchmarks.common import set_shapes

    cpu = probe()
    print(cpu.describe())
    passes = step_equivalents(args, world_sizes, os.cpu_count() or 1)
    if args.matrix_set == "default" and args.layers is None and args.width is None:
        choice = choose_size(passes, cpu, args.budget)
        args.layers, args.width, est, reason = choice.layers, choice.width, choice.estimate_s, choice.reason
    else:
        args.layers, args.width = args.layers or DEFAULT[0], args.width or DEFAULT[1]
        shapes = set_shapes(args.matrix_set, args.layers, args.width)
        est = estimate_s(shapes, passes, cpu.planning_bf16_gflops)
        within = "over" if est > args.budget else "within"
        reason = f"as given; estimated {est:.0f} s at bf16 {cpu.planning_bf16_gflops:.1f} GFLOP/s, {within} the budget"
    name = f"{args.layers} x {args.width}" if args.matrix_set == "default" else args.matrix_set
    count = len(set_shapes(args.matrix_set, args.layers, args.width))
    print(f"matrix set: {name} ({count} matrices): {reason}\n", flush=True)
    return {"cpu_probe": cpu.as_json(), "estimate_s": round(est, 1), "reason": reason}
