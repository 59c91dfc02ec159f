"""Gram Newton-Schulz against the standard iteration (Keller's quintic, 5 steps), side by side.

Two tables, one run, one process:

1. **Speed**: ``newton_schulz`` of one matrix per shape, standard then Gram (``ns_algorithm="gram"``),
   alternating, median of several calls each; the ratio Gram / standard, and the flop ratio
   ``orthogonalize_flops`` predicts. Shapes: every distinct shape of the CPU benchmark sets
   (``benchmarks/common.py``: default 8 x 512, gpt2, llama) and Llama-like ones; per
   set, the step's Newton-Schulz time (each shape's median times its count). The dtype is the one
   this CPU runs natively (``muon_dtensor.demo.cpu.probe``, as bench_step.py): bf16, or fp32 where
   bf16 is emulated (the output says so). One torch thread.
2. **Accuracy**: singular values of the output against a float64 SVD reference (the input's
   singular values mapped by the polynomial, ``scalar_map``), for both algorithms in bf16 and fp32,
   on 512 x 1376, 1024 x 2752 and 256 x 4096 (Llama-like aspect ratios) with three inputs: Gaussian,
   singular values log-spaced over 6 decades, and rank k/8 with exact zeros. "band" is [min, max] of
   the output singular values whose inputs converge (at least ``BAND_INPUT_FLOOR`` of the Frobenius
   norm), "max" the largest of all, "off" the largest distance to the reference.
3. **Restart study**: the Gram form in bfloat16 with other restart patterns than the rule's
   (``newton_schulz.gram_segments``), per preset: the largest output singular value and the largest
   distance to the reference over five small Llama-like shapes and five inputs (the three above,
   log-spaced over 2 decades, one dominant direction). What the rule was chosen by.

About 2-3 minutes on one thread of a native-bf16 CPU (the 2-core AMD EPYC of docs/benchmarks.md).

Examples, from the repository root::

    python benchmarks/bench_gram.py
    python benchmarks/bench_gram.py --skip-accuracy --repeats 9
    python benchmarks/bench_gram.py --out benchmarks/results/bench_gram_run2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import MATRIX_SETS, load_snapshot, set_shapes, system_info, wait_for_quiet  # noqa: E402
from muon_dtensor.demo.cpu import probe  # noqa: E402
from muon_dtensor.numerics.newton_schulz import (  # noqa: E402
    AOL_PRESETS,
    BAND_INPUT_FLOOR,
    PRESET_BANDS,
    NSConfig,
    gram_segments,
    newton_schulz,
    ns_flops,
    orthogonalize_flops,
    scalar_map,
)
from muon_dtensor.numerics.ns_config import resolve_ns_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
NS_MODULE = importlib.import_module("muon_dtensor.numerics.newton_schulz")  # not the function of that name
# Llama-like shapes; 2048 x 11059 is where others measured about 2x per call on a GPU.
ISSUE_SHAPES = [(512, 1376), (1024, 2752), (256, 4096), (2048, 11059)]
ACCURACY_SHAPES = [(512, 1376), (1024, 2752), (256, 4096)]
# Restart patterns the rule was chosen among (5 bfloat16 steps; restart before these iterations).
PATTERNS: dict[str, tuple[int, ...] | None] = {
    "none": (), "(1,)": (1,), "(2,)": (2,), "(3,)": (3,), "(1, 3)": (1, 3), "(2, 4)": (2, 4), "rule": None,
}  # fmt: skip
STUDY_SHAPES = [(64, 172), (172, 64), (32, 512), (128, 344), (256, 688)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape and algorithm (5)")
    p.add_argument(
        "--seconds", type=float, default=6.0, help="fewer repeats (at least 3) where a shape needs more (6)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--skip-accuracy", action="store_true", help="speed table only")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_gram.json", help="JSON results file")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- speed
def _time(x: torch.Tensor, config: NSConfig) -> float:
    start = time.perf_counter()
    newton_schulz(x, config)
    return time.perf_counter() - start


def time_shape(shape: tuple[int, int], dtype: torch.dtype, args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds of both algorithms on one matrix, calls alternating so load hits both alike."""
    standard = resolve_ns_config("keller", 5, 1e-7, dtype)
    gram = dataclasses.replace(standard, algorithm="gram")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    first = _time(x, standard) + _time(x, gram)  # warm-up, and the size of one pair
    repeats = max(3, min(args.repeats, int(args.seconds / first)))
    times: dict[str, list[float]] = {"standard": [], "gram": []}
    for i in range(repeats):
        order = [("standard", standard), ("gram", gram)][:: 1 if i % 2 == 0 else -1]
        for name, config in order:
            times[name].append(_time(x, config))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "shape": list(shape),
        "repeats": repeats,
        "standard_ms": ms["standard"],
        "gram_ms": ms["gram"],
        "ratio": ms["gram"] / ms["standard"],
        "flops_ratio": orthogonalize_flops(shape, gram) / ns_flops(shape, 5),
        "segments": [[r.start, r.stop] for r in gram_segments(gram)],
    }


def speed(dtype: torch.dtype, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-shape rows, then per-set totals."""
    sets = {name: Counter(set_shapes(name)) for name in MATRIX_SETS}
    shapes = sorted({s for counts in sets.values() for s in counts} | set(ISSUE_SHAPES))
    rows = {}
    for shape in shapes:
        rows[shape] = time_shape(shape, dtype, args)
        r = rows[shape]
        print(f"  {shape}: {r['standard_ms']:.1f} ms, Gram {r['gram_ms']:.1f} ms", flush=True)
    totals = []
    for name, counts in sets.items():
        std = sum(rows[s]["standard_ms"] * k for s, k in counts.items())
        gram = sum(rows[s]["gram_ms"] * k for s, k in counts.items())
        flops = sum(ns_flops(s, 5) * k for s, k in counts.items())
        gram_config = resolve_ns_config("keller", 5, 1e-7, dtype, "gram")
        gram_flops = sum(orthogonalize_flops(s, gram_config) * k for s, k in counts.items())
        totals.append(
            {"set": name, "matrices": sum(counts.values()), "standard_ms": std, "gram_ms": gram}
            | {"ratio": gram / std, "flops_ratio": gram_flops / flops}
        )
    return list(rows.values()), totals


def format_speed(rows: list[dict[str, Any]], totals: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | standard ms | Gram ms | ratio | flop ratio | Gram segments |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        segments = " ".join(f"{a}-{b - 1}" for a, b in r["segments"]) if r["flops_ratio"] < 1 else "standard"
        lines.append(
            f"| {r['shape'][0]} x {r['shape'][1]} | {r['standard_ms']:.1f} | {r['gram_ms']:.1f} "
            f"| {r['ratio']:.2f} | {r['flops_ratio']:.2f} | {segments} |"
        )
    lines += [
        "",
        "| set | matrices | standard ms | Gram ms | ratio | flop ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in totals:
        lines.append(
            f"| {t['set']} | {t['matrices']} | {t['standard_ms']:.0f} | {t['gram_ms']:.0f} "
            f"| {t['ratio']:.2f} | {t['flops_ratio']:.2f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- accuracy
def _with_spectrum(m: int, n: int, s: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(m, len(s), dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), dtype=torch.float64, generator=gen))
    return (u * s) @ v.T


def accuracy_inputs(m: int, n: int, more: bool = False) -> dict[str, torch.Tensor]:
    """Gaussian; singular values log-spaced over 6 decades; rank k/8 with exact zeros below. With
    ``more``: log-spaced over 2 decades, and one dominant direction over a 1e-4 floor."""
    gen = torch.Generator().manual_seed(0)
    k = min(m, n)
    low_rank = torch.zeros(k, dtype=torch.float64)
    low_rank[: k // 8] = torch.linspace(1.0, 0.05, k // 8, dtype=torch.float64)
    out = {
        "gaussian": torch.randn(m, n, dtype=torch.float64, generator=gen),
        "log-spaced 1e-6": _with_spectrum(m, n, torch.logspace(0, -6, k, dtype=torch.float64), gen),
        "rank k/8": _with_spectrum(m, n, low_rank, gen),
    }
    if more:
        spike = torch.full((k,), 1e-4, dtype=torch.float64)
        spike[0] = 1.0
        out["log-spaced 1e-2"] = _with_spectrum(m, n, torch.logspace(0, -2, k, dtype=torch.float64), gen)
        out["one spike"] = _with_spectrum(m, n, spike, gen)
    return out


def _band(values: torch.Tensor, converged: int) -> list[float]:
    top = values[:converged]
    return [float(top.min()), float(top.max()), float(values.max())]


def accuracy(emulated: bool) -> list[dict[str, Any]]:
    """One row per shape, input and dtype: the reference band and both algorithms' bands."""
    rows = []
    for shape in ACCURACY_SHAPES:
        dtypes = [torch.bfloat16, torch.float32]
        if emulated and shape[0] * shape[1] > 1 << 20:  # emulated bf16 takes minutes per call
            dtypes = [torch.float32]
        for name, x in accuracy_inputs(*shape).items():
            s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
            converged = int((s_in >= BAND_INPUT_FLOOR).sum())
            for dtype in dtypes:
                standard = resolve_ns_config("keller", 5, 1e-7, dtype)
                reference = scalar_map(s_in, standard).sort(descending=True).values
                row: dict[str, Any] = {"shape": list(shape), "input": name, "dtype": str(dtype)[6:]}
                row |= {"converged": converged, "reference": _band(reference, converged)}
                for algorithm in ("standard", "gram"):
                    out = newton_schulz(x.float(), dataclasses.replace(standard, algorithm=algorithm))
                    s_out = torch.linalg.svdvals(out.double())
                    row[algorithm] = _band(s_out, converged) + [float((s_out - reference).abs().max())]
                rows.append(row)
                print(f"  {shape} {name} {row['dtype']}: done", flush=True)
    return rows


def format_accuracy(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | input | dtype | reference band | standard band, max, off | Gram band, max, off |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = r["reference"]
        cells = [f"[{v[0]:.3f}, {v[1]:.3f}], {v[2]:.3f}, {v[3]:.3f}" for v in (r["standard"], r["gram"])]
        lines.append(
            f"| {r['shape'][0]} x {r['shape'][1]} | {r['input']} ({r['converged']} converge) | {r['dtype']} "
            f"| [{ref[0]:.3f}, {ref[1]:.3f}] | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- restart study
def _with_restarts(x: torch.Tensor, config: NSConfig, restarts: tuple[int, ...] | None) -> torch.Tensor:
    """``newton_schulz`` in the Gram form with restarts before ``restarts`` (None: the rule)."""
    if restarts is None:
        return newton_schulz(x, config)
    bounds = [0, *restarts, len(config.coefficients)]
    segments = [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    with mock.patch.object(NS_MODULE, "gram_segments", lambda _config: segments):
        return newton_schulz(x, config)


def restart_study() -> list[dict[str, Any]]:
    """Per preset (5 bfloat16 steps) and pattern: the largest output singular value and the largest
    distance to the reference over STUDY_SHAPES x 5 inputs; the standard iteration for comparison."""
    rows = []
    for preset in sorted(set(PRESET_BANDS) - AOL_PRESETS):  # turbo_muon runs only with "aol"
        config = resolve_ns_config(preset, 5, 1e-7, torch.bfloat16, "gram")
        worst = {name: [0.0, 0.0] for name in ["standard", *PATTERNS]}
        for shape in STUDY_SHAPES:
            for x in accuracy_inputs(*shape, more=True).values():
                s_in = torch.linalg.svdvals(x) / torch.linalg.matrix_norm(x)
                reference = scalar_map(s_in, config).sort(descending=True).values
                for name in worst:
                    if name == "standard":
                        out = newton_schulz(x.float(), dataclasses.replace(config, algorithm="standard"))
                    else:
                        out = _with_restarts(x.float(), config, PATTERNS[name])
                    s_out = torch.linalg.svdvals(out.double().nan_to_num(posinf=1e30, neginf=-1e30))
                    worst[name][0] = max(worst[name][0], float(s_out.max()))
                    worst[name][1] = max(worst[name][1], float((s_out - reference).abs().max()))
        rows.append({"preset": preset, "rule": [[r.start, r.stop] for r in gram_segments(config)], **worst})
        print(f"  {preset}: done", flush=True)
    return rows


def format_study(rows: list[dict[str, Any]]) -> str:
    names = ["standard", *PATTERNS]
    lines = ["| preset | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        lines.append(
            f"| {r['preset']} | " + " | ".join(f"{r[n][0]:.3g}, {r[n][1]:.3g}" for n in names) + " |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = wait_for_quiet(args.wait_quiet) if args.wait_quiet else load_snapshot()
    start = time.monotonic()
    cpu = probe()
    print(cpu.describe())
    dtype = cpu.ns_dtype
    note = "" if dtype == torch.bfloat16 else " (bf16 is emulated on this CPU: speed measured in float32)"
    print(f"Speed, Keller's quintic, 5 steps, {str(dtype)[6:]}{note}, {args.threads} thread(s):", flush=True)
    rows, totals = speed(dtype, args)
    print(format_speed(rows, totals))
    acc: list[dict[str, Any]] = []
    study: list[dict[str, Any]] = []
    if not args.skip_accuracy:
        print("Accuracy against a float64 SVD reference:", flush=True)
        acc = accuracy(cpu.emulated)
        print(format_accuracy(acc))
        print("Restart patterns, 5 bfloat16 steps (largest singular value, largest distance):", flush=True)
        study = restart_study()
        print(format_study(study))
    result = {
        "system": system_info(),
        "cpu_probe": cpu.as_json(),
        "ns_dtype": str(dtype)[6:],
        "threads": args.threads,
        "load_at_start": load,
        "load_at_end": load_snapshot(),
        "seconds": round(time.monotonic() - start, 1),
        "speed": rows,
        "sets": totals,
        "accuracy": acc,
        "restart_study": study,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seconds']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
