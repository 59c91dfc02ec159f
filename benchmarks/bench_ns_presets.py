"""Newton-Schulz presets side by side: how close to 1 each maps singular values, its flops and its time.

Per preset (``PRESETS``: keller, you, polar_express, deepseek_v4, cans, cubic5, turbo_muon), run for
its own ``PRESET_STEPS`` iterations (10 for deepseek_v4, 4 for turbo_muon, else 5); turbo_muon with
``ns_algorithm="aol"`` (Turbo-Muon, which it requires), the others with the standard iteration:

- **worst |s - 1|**: the largest distance from 1 of ``scalar_map`` (the polynomial the iteration
  applies to each singular value) over [BAND_INPUT_FLOOR, 1] of the normalized singular values, in
  float64 on a grid of 10^6 points; ``PRESET_BANDS`` are this map's range (for turbo_muon the
  singular values after AOL's scaling, which also bounds them by 1);
- **flops** per matrix (``ns_flops``, the standard iteration's count; cubic5's steps skip the A A
  product, so it runs ``executed`` flops: 2 m^3 fewer per step; AOL's scaling shares its A = X X^T
  with step 1, so turbo_muon counts 4 standard steps, its m n + 4 m^2 elementwise flops uncounted
  as the Frobenius division's 3 m n are);
- **time** per matrix: ``newton_schulz`` on one matrix, median of ``--repeats`` calls, presets
  alternating within each round so load touches all alike; one torch thread; bf16 where the CPU
  multiplies it natively (``muon_dtensor.demo.cpu.probe``), fp32 where it emulates it (printed).

Shapes 256 x 256, 512 x 1024 and 1024 x 256. About 10 s on one thread of a native-bf16 CPU.

From the repository root::

    python benchmarks/bench_ns_presets.py
    python benchmarks/bench_ns_presets.py --repeats 9 --out benchmarks/results/ns_presets_run2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_snapshot, results_config, system_info, wait_for_quiet  # noqa: E402
from muon_dtensor.demo.cpu import probe  # noqa: E402
from muon_dtensor.numerics.newton_schulz import (  # noqa: E402
    AOL_PRESETS,
    BAND_INPUT_FLOOR,
    PRESET_STEPS,
    PRESETS,
    NSConfig,
    newton_schulz,
    ns_flops,
    scalar_map,
)
from muon_dtensor.numerics.ns_config import resolve_ns_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SHAPES: list[tuple[int, int]] = [(256, 256), (512, 1024), (1024, 256)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9, help="timed calls per preset and shape (9)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=RESULTS / "ns_presets.json", help="JSON results file")
    return p.parse_args(argv)


def config_of(preset: str, dtype: torch.dtype) -> NSConfig:
    """The preset as Muon runs it: its own steps; an AOL preset with ``ns_algorithm="aol"``."""
    algorithm = "aol" if preset in AOL_PRESETS else "standard"
    return resolve_ns_config(preset, PRESET_STEPS[preset], 1e-7, dtype, algorithm)


def worst_deviation(preset: str) -> dict[str, float]:
    """The map's range over [BAND_INPUT_FLOOR, 1] and its largest distance from 1, float64."""
    config = config_of(preset, torch.float32)
    s = torch.linspace(BAND_INPUT_FLOOR, 1.0, 1_000_001, dtype=torch.float64)
    mapped = scalar_map(s, config)
    return {"min": float(mapped.min()), "max": float(mapped.max()), "worst": float((mapped - 1).abs().max())}


def executed_flops(shape: tuple[int, int], config: NSConfig) -> int:
    """``ns_flops`` less the A A product (2 m^3) of each cubic step (c == 0)."""
    m = min(shape)
    cubic = sum(1 for _, _, c in config.coefficients if c == 0.0)
    return ns_flops(shape, len(config.coefficients)) - cubic * 2 * m**3


def time_presets(configs: dict[str, NSConfig], shape: tuple[int, int], repeats: int) -> dict[str, float]:
    """Median ms per preset on one ``shape`` matrix; a warm-up round, then ``repeats`` rounds in
    which the presets alternate direction."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    names = list(configs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            newton_schulz(x, configs[name])
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def measure(dtype: torch.dtype, repeats: int) -> list[dict[str, Any]]:
    """One row per preset: steps, deviation, and per shape flops, executed flops and ms."""
    configs = {name: config_of(name, dtype) for name in PRESETS}
    ms = {shape: time_presets(configs, shape, repeats) for shape in SHAPES}
    rows = []
    for name, config in configs.items():
        per_shape = [
            {"shape": list(shape), "flops": ns_flops(shape, len(config.coefficients))}
            | {"executed_flops": executed_flops(shape, config), "ms": ms[shape][name]}
            for shape in SHAPES
        ]
        rows.append(
            {"preset": name, "steps": PRESET_STEPS[name], **worst_deviation(name), "shapes": per_shape}
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    shapes = " | ".join(f"{m}x{n} GFLOP, ms" for m, n in SHAPES)
    lines = [
        f"| preset | steps | map range | worst \\|s - 1\\| | {shapes} |",
        "|---" * (4 + len(SHAPES)) + "|",
    ]
    for r in rows:
        cells = []
        for s in r["shapes"]:
            flops = f"{s['flops'] / 1e9:.2f}"
            if s["executed_flops"] != s["flops"]:
                flops += f" ({s['executed_flops'] / 1e9:.2f} run)"
            cells.append(f"{flops}, {s['ms']:.1f}")
        name = f"{r['preset']} (aol)" if r["preset"] in AOL_PRESETS else r["preset"]
        head = f"| {name} | {r['steps']} | {r['min']:.3f} - {r['max']:.3f} | {r['worst']:.3f}"
        lines.append(f"{head} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = wait_for_quiet(args.wait_quiet) if args.wait_quiet else load_snapshot()
    start = time.monotonic()
    cpu = probe()
    print(cpu.describe())
    dtype = cpu.ns_dtype
    note = "" if dtype == torch.bfloat16 else " (bf16 is emulated on this CPU: timed in float32)"
    print(f"Timed in {str(dtype)[6:]}{note}, {args.threads} thread(s), median of {args.repeats}:", flush=True)
    rows = measure(dtype, args.repeats)
    print(format_table(rows))
    result = {
        "args": results_config(args),
        "system": system_info(),
        "cpu_probe": cpu.as_json(),
        "ns_dtype": str(dtype)[6:],
        "band_input_floor": BAND_INPUT_FLOOR,
        "load_at_start": load,
        "load_at_end": load_snapshot(),
        "seconds": round(time.monotonic() - start, 1),
        "presets": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seconds']:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
