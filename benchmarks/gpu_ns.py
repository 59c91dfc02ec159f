"""Batched bf16 Newton-Schulz TFLOP/s on one CUDA GPU, against the measured bf16 matmul peak.

Prepared for an H200. For each shape it stacks B random matrices, B chosen so
one call of ``muon_dtensor.numerics.newton_schulz.newton_schulz`` (5 Keller iterations, bf16) takes about
100 ms at the measured peak, and times it eagerly and under ``torch.compile``. Flops are
``ns_flops`` (4 m^2 n + 2 m^3 per iteration: X X^T, its square, and the product with X). The
peak is an 8192^3 bf16 ``torch.mm`` on random data (never zeros: GPUs can run a product of zeros
faster than real data). Times are medians of CUDA-event timings after warmup. Goal: >= 70% of the measured peak on 4096-class
matrices (4096^2 and 4096x14336).

Exits with status 2 and a message on stderr when no CUDA device is present.

Examples, from the repository root::

    python benchmarks/gpu_ns.py    # writes $OUT/gpu_ns.json if OUT is set, else benchmarks/results/
    python benchmarks/gpu_ns.py --no-compile --target-ms 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from muon_dtensor import newton_schulz, resolve_ns_config  # noqa: E402
from muon_dtensor.numerics.newton_schulz import ns_flops  # noqa: E402

SHAPES = [(1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192), (4096, 14336)]
GOAL_SHAPES = {(4096, 4096), (4096, 14336)}
GOAL = 0.70  # goal: batched NS at >= 70% of the measured matmul peak on 4096-class matrices
PEAK_N = 8192
NS_STEPS = 5
# Keep one stack's input under this many bytes; NS holds about 4 such buffers at once (X, A, B, new X).
MAX_STACK_BYTES = 8 * 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-ms", type=float, default=100.0, help="time of one call at peak (100)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per case (10)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile runs")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file ($OUT/gpu_ns.json or benchmarks/results)"
    )
    return p.parse_args(argv)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "gpu_ns.py: no CUDA device is present (torch.cuda.is_available() is False); "
            "run it on a machine with a GPU",
            file=sys.stderr,
        )
        sys.exit(2)


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 3) -> list[float]:
    """CUDA-event milliseconds of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def matmul_peak(reps: int) -> dict[str, Any]:
    """bf16 TFLOP/s of an 8192^3 torch.mm on random data, median of at least 50 calls."""
    a = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    # Many short calls, so the clocks ramp up during warmup and the median is steady.
    times = time_ms(lambda: torch.mm(a, b), max(reps, 50), warmup=20)
    tflops = 2 * PEAK_N**3 / (statistics.median(times) * 1e-3) / 1e12
    return {"n": PEAK_N, "times_ms": times, "tflops": tflops}


def batch_size(shape: tuple[int, int], peak_tflops: float, target_ms: float) -> int:
    flops = ns_flops(shape, NS_STEPS)
    by_time = math.ceil(target_ms * 1e-3 * peak_tflops * 1e12 / flops)
    by_memory = max(1, MAX_STACK_BYTES // (2 * shape[0] * shape[1]))
    return max(1, min(by_time, by_memory))


def run_case(shape: tuple[int, int], batch: int, compiled: bool, reps: int, peak: float) -> dict[str, Any]:
    """TFLOP/s of one batched Newton-Schulz call on ``batch`` matrices of ``shape``."""
    config = resolve_ns_config((3.4445, -4.7750, 2.0315), NS_STEPS, 1e-7)
    x = torch.randn(batch, *shape, device="cuda", dtype=torch.bfloat16)

    def call(t: torch.Tensor) -> torch.Tensor:
        return newton_schulz(t, config)

    fn = torch.compile(call, dynamic=False) if compiled else call
    times = time_ms(lambda: fn(x), reps)
    median = statistics.median(times)
    tflops = batch * ns_flops(shape, NS_STEPS) / (median * 1e-3) / 1e12
    finite = bool(torch.isfinite(fn(x)).all())
    return {
        "shape": list(shape),
        "batch": batch,
        "compiled": compiled,
        "times_ms": times,
        "median_ms": median,
        "tflops": tflops,
        "fraction_of_peak": tflops / peak,
        "finite": finite,
    }


def system_info() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "multiprocessors": props.multi_processor_count,
        "gpu_memory_gib": props.total_memory / 2**30,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def format_table(peak: float, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"measured bf16 matmul peak ({PEAK_N}^3 torch.mm, random data): {peak:.1f} TFLOP/s",
        "",
        "| shape | batch | compiled | median ms | NS TFLOP/s | fraction of measured peak |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        m, n = r["shape"]
        lines.append(
            f"| {m}x{n} | {r['batch']} | {'yes' if r['compiled'] else 'no'} | {r['median_ms']:.1f} "
            f"| {r['tflops']:.1f} | {r['fraction_of_peak']:.2f} |"
        )
    return "\n".join(lines)


def goal_verdict(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per 4096-class shape: does the better of eager and compiled reach GOAL of the peak?"""
    verdict: dict[str, bool] = {}
    for shape in sorted(GOAL_SHAPES):
        best = max(r["fraction_of_peak"] for r in rows if tuple(r["shape"]) == shape)
        verdict[f"{shape[0]}x{shape[1]} >= {GOAL:.0%} of peak"] = best >= GOAL
    return verdict


def output_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_ns.json"
    return ROOT / "benchmarks" / "results" / "gpu_ns.json"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda()
    torch.manual_seed(0)
    peak = matmul_peak(args.reps)
    print(f"peak: {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows = []
    for shape in SHAPES:
        batch = batch_size(shape, peak["tflops"], args.target_ms)
        for compiled in (False,) if args.no_compile else (False, True):
            rows.append(run_case(shape, batch, compiled, args.reps, peak["tflops"]))
            torch.cuda.empty_cache()
            print(f"{shape} batch {batch} compiled={compiled}: {rows[-1]['tflops']:.1f} TFLOP/s", flush=True)
    verdict = goal_verdict(rows)
    print(format_table(peak["tflops"], rows))
    ok = all(verdict.values()) and all(r["finite"] for r in rows)
    print(
        ("PASS: " if ok else "FAIL: ") + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in verdict.items())
    )
    path = output_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        **system_info(),
        "peak": peak,
        "rows": rows,
        "goal": verdict,
        "verdict": "PASS" if ok else "FAIL",
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {path}")


if __name__ == "__main__":
    main()
