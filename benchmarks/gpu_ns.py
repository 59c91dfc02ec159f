"""Batched bf16 Newton-Schulz TFLOP/s on one CUDA GPU, against the measured bf16 matmul peak.

Prepared for an H200. For each shape it stacks B random matrices, B chosen so
one call of ``muon_dtensor.numerics.newton_schulz.newton_schulz`` (5 Keller iterations, bf16) takes about
100 ms at the measured peak, and times it eagerly and under ``torch.compile``. Flops are
``ns_flops`` (4 m^2 n + 2 m^3 per iteration: X X^T, its square, and the product with X). The
peak is an 8192^3 bf16 ``torch.mm`` on random data (never zeros: GPUs can run a product of zeros
faster than real data). Times are medians of CUDA-event timings after warmup. Goal: >= 70% of the measured peak on 4096-class
matrices (4096^2 and 4096x14336).

The measuring functions live in ``benchmarks/gpucheck/ns_speed.py``, which ``gpu_check.py`` (part
b) runs with the Gram form and Llama-3 shapes too; this script is the standard form alone.

Each case runs in its own try/except (a failing case is recorded under ``errors`` and the others
still run); the JSON is rewritten after every case; no case starts after ``--budget-s`` seconds.
Exits with status 2 and a message on stderr when no CUDA device is present.

Examples, from the repository root::

    python benchmarks/gpu_ns.py    # writes $OUT/gpu_ns.json if OUT is set, else benchmarks/results/
    python benchmarks/gpu_ns.py --no-compile --target-ms 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpucheck.ns_speed import (  # noqa: E402
    PEAK_N,
    SHAPES,
    batch_size,
    format_table,
    goal_verdict,
    matmul_peak,
    run_case,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target-ms", type=float, default=100.0, help="time of one call at peak (100)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per case (10)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile runs")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no case after this many s (420)")
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
    started = time.perf_counter()
    path = output_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {**system_info(), "budget_s": args.budget_s, "rows": [], "errors": []}

    def save() -> None:  # after every case: a run stopped early keeps what it measured
        payload["elapsed_s"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(payload, indent=2) + "\n")

    peak = payload["peak"] = matmul_peak(args.reps)
    save()
    print(f"peak: {peak['tflops']:.1f} TFLOP/s", flush=True)
    rows, errors = payload["rows"], payload["errors"]
    for shape in SHAPES:
        for compiled in (False,) if args.no_compile else (False, True):
            case = {"shape": list(shape), "compiled": compiled}
            if time.perf_counter() - started > args.budget_s:
                errors.append(case | {"skipped": "--budget-s spent"})
                continue
            try:
                batch = batch_size(shape, peak["tflops"], args.target_ms)
                rows.append(run_case(shape, batch, compiled, args.reps, peak["tflops"]))
                print(
                    f"{shape} batch {batch} compiled={compiled}: {rows[-1]['tflops']:.1f} TFLOP/s", flush=True
                )
            except Exception as exc:  # noqa: BLE001 - one case's failure is recorded, the others run
                errors.append(case | {"error": f"{type(exc).__name__}: {exc}"})
                print(f"{shape} compiled={compiled}: {errors[-1]['error']}", flush=True)
            torch.cuda.empty_cache()
            save()
    verdict = payload["goal"] = goal_verdict(rows)
    print(format_table(peak["tflops"], rows, PEAK_N))
    ok = all(verdict.values()) and all(r["finite"] for r in rows) and not errors
    print(
        ("PASS: " if ok else "FAIL: ") + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in verdict.items())
    )
    payload["verdict"] = "PASS" if ok else "FAIL"
    save()
    print(f"results written to {path}")


if __name__ == "__main__":
    main()
