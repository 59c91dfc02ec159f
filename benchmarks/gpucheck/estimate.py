"""A run's settings (the full run on one H200, or the CPU dry run), its time estimate from the
shapes' flops, and the trimming that keeps the estimate within ``--budget-s``.

The estimate assumes ASSUMED_TFLOPS of bf16 dense matmul throughput: the H200 SXM datasheet says
989 TFLOP/s dense; large bf16 GEMMs reach about 700 to 790 in practice (docs/benchmarks.md, "Where
the H200 figures come from"), and Newton-Schulz's smaller products less. Everything that is not a
matmul is a fixed allowance below (start-up, compiles, host time per eager step, rank start-up):
assumptions, stated in the JSON, that the first run's measured times replace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpucheck.common import (
    DRY_DIMS,
    DRY_SHAPES,
    LLAMA_8B,
    LLAMA_8B_DIMS,
    LLAMA_70B,
    Settings,
    Shape,
)
from benchmarks.gpucheck.graphs import VARIANTS
from benchmarks.gpucheck.ns_speed import batch_size, cases, ns_config
from benchmarks.gpucheck.ranks import STEPS as RANK_STEPS
from benchmarks.gpucheck.ranks import meshes
from muon_dtensor.numerics.newton_schulz import ns_flops, orthogonalize_flops

ASSUMED_TFLOPS = 700.0
ALLOWANCES_S = {
    "start": 20.0,  # imports, CUDA context, cuBLAS handles
    "compile_first": 60.0,  # torch.compile's first graph (Inductor and Triton start-up)
    "compile_each": 15.0,  # each further compiled case (a new shape recompiles)
    "call": 0.05,  # per timed or checked call: launch, event sync, randn, comparisons
    "host_step": 0.05,  # host time of one eager optimizer step at Llama-3-8B width
    "profile": 5.0,  # one profiled step: profiler start-up and the event walk
    "ranks": 60.0,  # part (e): rank processes, NCCL and gloo start-up
}
B_SHAPES: list[Shape] = [
    (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192),
    (1024, 4096), (4096, 14336), (1024, 8192), (8192, 28672),
]  # fmt: skip
B_COMPILE_SHAPES: list[Shape] = [(4096, 4096), (4096, 14336), (8192, 28672)]


def full_settings(budget_s: float, compile: bool) -> Settings:
    """The run on one H200: Llama-3-8B and 70B shapes, two 8B layers for the steps."""
    return Settings(
        device=torch.device("cuda"), dry_run=False, budget_s=budget_s,
        a_shapes=LLAMA_8B | LLAMA_70B, a_batches=(2, 4, 8, 16, 32, 64), max_stack_bytes=16 * 2**30,
        b_shapes=list(B_SHAPES), b_compile_shapes=list(B_COMPILE_SHAPES), peak_n=8192,
        reps=10, warmup=3, target_ms=100.0, compile=compile,
        layers=2, dims=LLAMA_8B_DIMS, step_reps=10, lockstep=5, b_one_shapes=list(LLAMA_8B.values()),
    )  # fmt: skip


def dry_settings(budget_s: float) -> Settings:
    """Every part on CPU with tiny shapes (no compile)."""
    return Settings(
        device=torch.device("cpu"), dry_run=True, budget_s=budget_s,
        a_shapes=dict(DRY_SHAPES), a_batches=(2, 4, 8), max_stack_bytes=2**20,
        b_shapes=[(64, 64), (32, 64)], b_compile_shapes=[], peak_n=64,
        reps=3, warmup=1, target_ms=2.0, compile=False,
        layers=1, dims=DRY_DIMS, step_reps=2, lockstep=2, b_one_shapes=[(64, 32)],
    )  # fmt: skip


def seconds(flops: float) -> float:
    return flops / (ASSUMED_TFLOPS * 1e12)


def estimate_a(s: Settings) -> float:
    total = 0.0
    for shape in s.a_shapes.values():
        fits = [b for b in s.a_batches if b * shape[0] * shape[1] * 2 <= s.max_stack_bytes]
        calls = 4 + len(fits)  # lone, again, batch of one, torch's; one per batch size
        total += seconds(ns_flops(shape, 5) * (4 + sum(fits))) + calls * ALLOWANCES_S["call"]
    return total


def estimate_b(s: Settings) -> float:
    calls = max(s.reps, 50) + 20
    total = calls * (seconds(2 * s.peak_n**3) + ALLOWANCES_S["call"] / 10)
    compiled = 0
    for shape, algorithm, is_compiled, one in cases(s):
        config = ns_config(algorithm)
        batch = 1 if one else batch_size(shape, ASSUMED_TFLOPS, s.target_ms, config)
        call = seconds(batch * orthogonalize_flops(shape, config))
        total += (1 + s.warmup + s.reps) * (call + ALLOWANCES_S["call"])
        if one:  # and its host-issue timing (ns_speed.host_against_device)
            total += (s.warmup + s.reps) * (call + ALLOWANCES_S["call"])
        if is_compiled:
            total += ALLOWANCES_S["compile_first" if compiled == 0 else "compile_each"]
            compiled += 1
    return total


def step_seconds(s: Settings) -> float:
    """One eager Muon step of ``s.layers`` layers: its Newton-Schulz flops and the host allowance."""
    d = s.dims
    shapes = [(d.width, d.width)] * 2 + [(d.kv, d.width)] * 2 + [(d.ffn, d.width)] * 2 + [(d.width, d.ffn)]
    return s.layers * seconds(sum(ns_flops(x, 5) for x in shapes)) + ALLOWANCES_S["host_step"]


def estimate_c(s: Settings) -> float:
    steps = 1 + s.warmup + s.step_reps + 1  # the first, warmup, timed, sync check (profiled: warmup)
    muon = 5 * steps * step_seconds(s)  # muon_dtensor (float32, bf16, int8 momentum; AOL), torch.optim.Muon
    return muon + steps * ALLOWANCES_S["host_step"] + 6 * ALLOWANCES_S["profile"]


def estimate_d(s: Settings) -> float:
    steps = 2 * (s.warmup + s.lockstep + s.step_reps) + 1
    return len(VARIANTS) * (steps * step_seconds(s) + 2.0)


def estimate_e(s: Settings, gpus: int) -> float:
    if gpus < 2:
        return 0.0
    runs = 2 * len(meshes(min(gpus, 8)))
    return ALLOWANCES_S["ranks"] + runs * (2 * RANK_STEPS + 5) * step_seconds(s)


def estimate(s: Settings, gpus: int = 1) -> dict[str, Any]:
    """Seconds per part and in all, for ``gpus`` visible GPUs."""
    parts = {
        "a": estimate_a(s), "b": estimate_b(s), "c": estimate_c(s), "d": estimate_d(s),
        "e": estimate_e(s, gpus),
    }  # fmt: skip
    total = ALLOWANCES_S["start"] + sum(parts.values())
    return {
        "total_s": round(total, 1),
        "parts_s": {k: round(v, 1) for k, v in parts.items()},
        "gpus": gpus,
        "assumed_bf16_tflops": ASSUMED_TFLOPS,
        "allowances_s": dict(ALLOWANCES_S),
    }


# name -> how one trim changes it; a trim that changes nothing has reached its floor.
TRIMS: list[tuple[str, Callable[[Any], Any]]] = [
    ("reps", lambda v: max(3, v - 2)),
    ("step_reps", lambda v: max(3, v - 2)),
    ("target_ms", lambda v: max(25.0, v / 2)),
    ("compile", lambda v: False),
]


def fit_budget(s: Settings, gpus: int = 1) -> Settings:
    """``s`` with repetitions, then call length, then compiles trimmed until the estimate fits
    ``s.budget_s``; then every earlier trim a later one made needless is undone. ``trims`` names
    what changed."""
    original = s

    def fits(t: Settings) -> bool:
        return estimate(t, gpus)["total_s"] <= t.budget_s

    for name, cut in TRIMS:
        while not fits(s) and cut(getattr(s, name)) != getattr(s, name):
            s = dataclasses.replace(s, **{name: cut(getattr(s, name))})
    for name, _ in reversed(TRIMS):
        restored = dataclasses.replace(s, **{name: getattr(original, name)})
        if fits(restored):
            s = restored
    trims = [
        f"{n}: {getattr(original, n)} -> {getattr(s, n)}"
        for n, _ in TRIMS
        if getattr(original, n) != getattr(s, n)
    ]
    return dataclasses.replace(s, trims=trims)
