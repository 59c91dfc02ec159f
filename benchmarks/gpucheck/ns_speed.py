"""(b) Newton-Schulz TFLOP/s against the measured bf16 matmul peak (the logic of gpu_ns.py).

For each shape it stacks B random matrices, B chosen so one call of ``newton_schulz`` (5 Keller
iterations, bf16) takes about ``target_ms`` at the measured peak, and times it eagerly and under
``torch.compile``, in the standard form and, where ``uses_gram`` says it saves flops, the Gram form
(``ns_algorithm="gram"``). Flops are ``orthogonalize_flops`` (the form's own count); the
standard-equivalent rate divides the standard count (``ns_flops``) by the same time, so the two
forms compare as time per matrix. The peak is an n^3 bf16 ``torch.mm`` on random data (never zeros:
GPUs can run a product of zeros faster than real data). Times are medians of CUDA-event timings
after warmup. Goal: >= 70% of the measured peak on 4096-class matrices (4096^2 and 4096x14336).
Batch-1 rows at Llama-3-8B's shapes are the step's own calls (one matrix fills an exchange round);
beside each, the host's time to issue the call against its device time.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from benchmarks.gpucheck.common import Settings, Shape, clock, error_text, sync, time_ms
from muon_dtensor import DEFAULT_COEFFICIENTS, NSConfig, newton_schulz, resolve_ns_config
from muon_dtensor.numerics.newton_schulz import ns_flops, orthogonalize_flops, uses_gram

SHAPES: list[Shape] = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (4096, 14336)]
GOAL_SHAPES = {(4096, 4096), (4096, 14336)}
GOAL = 0.70  # goal: batched NS at >= 70% of the measured matmul peak on 4096-class matrices
PEAK_N = 8192
NS_STEPS = 5
# Keep one stack's input under this many bytes; NS holds about 4 such buffers at once (X, A, B, new X).
MAX_STACK_BYTES = 8 * 2**30


def ns_config(algorithm: str = "standard") -> NSConfig:
    return resolve_ns_config(DEFAULT_COEFFICIENTS, NS_STEPS, 1e-7, algorithm=algorithm)


def matmul_peak(reps: int, n: int = PEAK_N, device: torch.device | None = None) -> dict[str, Any]:
    """bf16 TFLOP/s of an n^3 torch.mm on random data, median of at least 50 calls."""
    device = device or torch.device("cuda")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    # Many short calls, so the clocks ramp up during warmup and the median is steady.
    times = time_ms(lambda: torch.mm(a, b), max(reps, 50), 20, device)
    tflops = 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12
    return {"n": n, "times_ms": times, "tflops": tflops, "clock": clock(device)}


def batch_size(
    shape: Shape, peak_tflops: float, target_ms: float, config: NSConfig | None = None,
    max_bytes: int = MAX_STACK_BYTES,
) -> int:  # fmt: skip
    """Matrices per call so one call takes ``target_ms`` at the peak, within ``max_bytes``."""
    flops = orthogonalize_flops(shape, config or ns_config())
    by_time = math.ceil(target_ms * 1e-3 * peak_tflops * 1e12 / flops)
    by_memory = max(1, max_bytes // (2 * shape[0] * shape[1]))
    return max(1, min(by_time, by_memory))


def run_case(
    shape: Shape, batch: int, compiled: bool, reps: int, peak: float, algorithm: str = "standard",
    device: torch.device | None = None, warmup: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """TFLOP/s of one batched Newton-Schulz call on ``batch`` matrices of ``shape``."""
    device = device or torch.device("cuda")
    config = ns_config(algorithm)
    x = torch.randn(batch, *shape, device=device, dtype=torch.bfloat16)

    def call(t: torch.Tensor) -> torch.Tensor:
        return newton_schulz(t, config)

    fn = torch.compile(call, dynamic=False) if compiled else call
    start = time.perf_counter()
    finite = bool(torch.isfinite(fn(x)).all())  # the first call compiles
    first_s = time.perf_counter() - start
    times = time_ms(lambda: fn(x), reps, warmup, device)
    median = statistics.median(times)
    own, standard = orthogonalize_flops(shape, config), ns_flops(shape, NS_STEPS)
    tflops = batch * own / (median * 1e-3) / 1e12
    return {
        "shape": list(shape),
        "batch": batch,
        "algorithm": algorithm,
        "compiled": compiled,
        "first_call_s": first_s,
        "times_ms": times,
        "median_ms": median,
        "flops_per_matrix": own,
        "tflops": tflops,
        "standard_equivalent_tflops": batch * standard / (median * 1e-3) / 1e12,
        "fraction_of_peak": tflops / peak,
        "finite": finite,
    }


def host_against_device(shape: Shape, device_ms: float, settings: Settings) -> dict[str, Any]:
    """A batch-1 call is one exchange round's work where one matrix fills a round: the host's time
    to issue it (no sync, from an idle device) against its device time. Below 1, the next round's
    launches can hide behind this round's kernels."""
    x = torch.randn(1, *shape, device=settings.device, dtype=torch.bfloat16)
    config, host = ns_config(), []
    for _ in range(settings.warmup + settings.reps):
        sync(settings.device)
        start = time.perf_counter()
        newton_schulz(x, config)
        host.append((time.perf_counter() - start) * 1e3)
    sync(settings.device)
    issue = statistics.median(host[settings.warmup :])
    return {"host_issue_ms": issue, "host_over_device": issue / device_ms if device_ms else None}


def cases(settings: Settings) -> list[tuple[Shape, str, bool, bool]]:
    """(shape, algorithm, compiled, batch of one) to run: Gram only where it changes the
    evaluation; then one matrix per call at ``b_one_shapes`` (the step's real calls at Llama
    sizes); compiled only for ``b_compile_shapes`` and with compile on, after every eager case
    (compile times are the least predictable part of the run)."""
    gram = ns_config("gram")
    eager = [
        (s, a, False, False)
        for s in settings.b_shapes
        for a in ("standard", "gram")
        if a == "standard" or uses_gram(s, gram)
    ]
    eager += [(s, "standard", False, True) for s in settings.b_one_shapes]
    if not settings.compile:
        return eager
    return eager + [
        (s, a, True, False) for s, a, _, one in eager if s in settings.b_compile_shapes and not one
    ]


def part_b(settings: Settings) -> dict[str, Any]:
    """The measured peak, then every case; a case that fails or would overrun records why."""
    peak = matmul_peak(settings.reps, settings.peak_n, settings.device)
    print(f"  matmul peak {peak['tflops']:.4g} TFLOP/s ({peak['clock']})", flush=True)
    rows: list[dict[str, Any]] = []
    for shape, algorithm, compiled, one in cases(settings):
        label = {"shape": list(shape), "algorithm": algorithm, "compiled": compiled, "batch_of_one": one}
        if settings.left_s() - settings.reserve_s < (60 if compiled else 15):
            rows.append(label | {"skipped": "--budget-s spent"})
            continue
        batch = 1 if one else batch_size(shape, peak["tflops"], settings.target_ms, ns_config(algorithm))
        try:
            rows.append(run_case(shape, batch, compiled, settings.reps, peak["tflops"], algorithm,
                                 settings.device, settings.warmup) | {"batch_of_one": one})  # fmt: skip
            if one:
                rows[-1] |= host_against_device(shape, rows[-1]["median_ms"], settings)
        except Exception as exc:  # noqa: BLE001 - one case's failure is recorded, the rest run
            rows.append(label | {"batch": batch, "error": error_text(exc)})
        if settings.cuda:
            torch.cuda.empty_cache()
    timed = [r for r in rows if "tflops" in r]
    return {"peak": peak, "clock": clock(settings.device), "rows": rows, "goal": goal_verdict(timed)}


def format_table(peak: float, rows: list[dict[str, Any]], n: int = PEAK_N) -> str:
    lines = [
        f"measured bf16 matmul peak ({n}^3 torch.mm, random data): {peak:.4g} TFLOP/s",
        "",
        "| shape | algorithm | batch | compiled | median ms | NS TFLOP/s | fraction of measured peak |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if "tflops" not in r:
            continue
        m, n_ = r["shape"]
        lines.append(
            f"| {m}x{n_} | {r.get('algorithm', 'standard')} | {r['batch']} | {'yes' if r['compiled'] else 'no'} "
            f"| {r['median_ms']:.4g} | {r['tflops']:.4g} | {r['fraction_of_peak']:.2f} |"
        )
    return "\n".join(lines)


def goal_verdict(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per 4096-class shape measured: does the best standard case reach GOAL of the peak?"""
    verdict: dict[str, bool] = {}
    for shape in sorted(GOAL_SHAPES):
        fractions = [
            r["fraction_of_peak"]
            for r in rows
            if tuple(r["shape"]) == shape and r.get("algorithm", "standard") == "standard"
        ]
        if fractions:
            verdict[f"{shape[0]}x{shape[1]} >= {GOAL:.0%} of peak"] = max(fractions) >= GOAL
    return verdict
