"""One prepared check that settles the GPU path in one short run (at most 8 minutes on one H200).

Parts, each timed with CUDA events after warmup on random data, each in its own try/except (a
failing part records its error and the others still run):

  a. batch independence: a Llama-3-8B and -70B layer's matrices, alone and in batches of 2 to 64 at
     the first, middle and last position, bit for bit; and through torch.optim.Muon's path;
  b. Newton-Schulz TFLOP/s against the measured bf16 matmul peak, standard and Gram, eager and
     compiled (``--no-compile`` skips compiling; the logic of gpu_ns.py);
  c. one-GPU step: muon_dtensor.Muon (float32, bf16 and int8 momentum, and ns_algorithm="aol"),
     torch.optim.Muon and fused AdamW on two Llama-3-8B layers: step, host and device time, peak
     memory, eager ops, host time per op against the 5 us host model;
  d. CUDA-graph capture of a steady muon_dtensor.Muon step with the lr changing every step, the
     expected outcome beside each variant, the one expected to fail last;
  e. with 2+ GPUs: FSDP2 and HSDP steps against one process, bitwise, and no host sync.

At start it prints its time estimate (from the shapes' flops at an assumed bf16 rate, see
``benchmarks/gpucheck/estimate.py``) and trims repetitions to fit ``--budget-s``. The budget is
also a deadline: a part still running when it ends is stopped (recorded as an error) and the parts
after it are skipped, each with its JSON written. The one-line command for the GPU machine is in
``benchmarks/README.md``. Part b runs after
c, and its compiled cases last, within what the later parts leave. Writes ``$OUT/gpu_check.json``
when OUT is set, else ``benchmarks/results/gpu_check.json``, and prints a short table. Exit status:
0 when every part ran or was skipped, 1 when a part failed, 2 without CUDA (and no ``--dry-run``).

``--dry-run`` runs every part on CPU with tiny shapes, one torch thread, in well under a minute;
what needs CUDA (events, graphs, NCCL) is reported as skipped with the reason (d's lockstep harness
runs with eager steps, e's on 2 gloo CPU ranks).

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --dry-run
    python benchmarks/gpu_check.py --estimate-only --budget-s 300
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gpucheck.batch import part_a  # noqa: E402
from benchmarks.gpucheck.common import Settings, run_part  # noqa: E402
from benchmarks.gpucheck.estimate import dry_settings, estimate, fit_budget, full_settings  # noqa: E402
from benchmarks.gpucheck.graphs import part_d  # noqa: E402
from benchmarks.gpucheck.ns_speed import format_table, part_b  # noqa: E402
from benchmarks.gpucheck.ranks import part_e  # noqa: E402
from benchmarks.gpucheck.report import table  # noqa: E402
from benchmarks.gpucheck.step import part_c  # noqa: E402

NAMES = {
    "a": "batch independence",
    "b": "Newton-Schulz TFLOP/s",
    "c": "one-GPU step",
    "d": "CUDA graphs",
    "e": "ranks (2+ GPUs)",
}
ORDER = ("a", "c", "b", "d", "e")  # b's compiles are the least predictable: after c, within a reserve
PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every part on CPU, tiny shapes")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds the run may take (420)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile in part b")
    p.add_argument("--estimate-only", action="store_true", help="print the estimate and stop")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON file ($OUT/gpu_check.json or benchmarks/results)"
    )
    return p.parse_args(argv)


def output_path(args: argparse.Namespace) -> Path:
    if args.out is not None:
        return args.out
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "benchmarks" / "results" / "gpu_check.json"


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def print_estimate(full: Settings, gpus: int) -> dict[str, Any]:
    """The full run's estimate (what ``--dry-run`` would take on one H200 is not this)."""
    est = estimate(full, max(gpus, 1))
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in est["parts_s"].items())
    print(
        f"estimate for the full run: {est['total_s']:.0f} s of GPU time on {max(gpus, 1)} GPU(s) "
        f"(assuming {est['assumed_bf16_tflops']:.0f} TFLOP/s bf16 dense achievable on an H200, plus "
        f"fixed allowances for start-up, compiles and host time); per part: {parts}; "
        f"budget {full.budget_s:.0f} s" + (f"; trimmed: {', '.join(full.trims)}" if full.trims else ""),
        flush=True,
    )
    return est


def system_info(settings: Settings) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": str(settings.device),
        "gpus": gpu_count(),
    }
    if settings.cuda:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    return info


def run_all(
    settings: Settings, est: dict[str, Any], save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Every part in ORDER (b keeps back what d and e are estimated to need), keyed a to e; after
    each part, ``save`` gets what is done so far (a run cut short still leaves its JSON)."""
    settings.started = time.perf_counter()
    parts: dict[str, dict[str, Any]] = {}
    for key in ORDER:
        settings.reserve_s = est["parts_s"]["d"] + est["parts_s"]["e"] + 30.0 if key == "b" else 0.0
        parts[key] = run_part(f"{key} {NAMES[key]}", PARTS[key], settings)
        save({k: parts[k] for k in sorted(parts)})
    return {k: parts[k] for k in sorted(parts)}


def shown(path: Path) -> str:
    """``path`` without the machine's folders: relative to the repository, or under $OUT."""
    if os.environ.get("OUT") and path.parent == Path(os.environ["OUT"]):
        return f"$OUT/{path.name}"
    return str(path.relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else path.name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = gpu_count()
    full = fit_budget(full_settings(args.budget_s, not args.no_compile), max(gpus, 1))
    est = print_estimate(full, gpus)
    if args.estimate_only:
        return 0
    if not args.dry_run and gpus == 0:
        print("gpu_check.py: no CUDA device is present; run it on a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    settings = dry_settings(args.budget_s) if args.dry_run else full
    if settings.dry_run:  # one thread: on a busy machine, OpenMP threads wait for each other
        torch.set_num_threads(1)
    torch.manual_seed(0)
    path = output_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    head = {**system_info(settings), "dry_run": settings.dry_run, "budget_s": settings.budget_s}
    head |= {"trims": full.trims, "full_run_estimate": est}

    def save(parts: dict[str, Any]) -> None:
        payload = head | {"elapsed_s": round(time.perf_counter() - started, 1), "parts": parts}
        path.write_text(json.dumps(payload, indent=2, default=str) + "\n")

    parts = run_all(settings, est, save)
    b = parts["b"]
    if b["status"] == "ok":
        print(format_table(b["result"]["peak"]["tflops"], b["result"]["rows"], settings.peak_n))
    print(table(parts, NAMES))
    print(f"took {time.perf_counter() - started:.0f} s; results written to {shown(path)}")
    return 1 if any(p["status"] == "error" for p in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
