"""Split Newton-Schulz in the step (``ns_split``) against whole matrices, side by side on 2 gloo ranks.

Where one matrix's Newton-Schulz is most of the work, its owner bounds the step and the other rank
waits. Contenders, on one (w, 4w) matrix and four (w/4, w/4) ones, FSDP ``Shard(0)`` over 2 ranks,
seeded gradients set once and stepped repeatedly, ``muon_dtensor.Muon(lr=0.02)`` otherwise:

1. ``ns_split="off"``: every matrix on one owner;
2. ``ns_split=2``: every matrix's iteration over both ranks;
3. ``ns_split="auto"``: the cost model's choice (H200 figures).

w is picked so the large matrix's Newton-Schulz takes about ``--seconds`` on one thread at this CPU's
measured rate, in bf16 where this CPU multiplies it natively, else in fp32 (the output says which).
Timed steps alternate between the contenders after each one's warmup; a step's time is the slowest
rank's (a barrier before each step); the table shows the median and the ratio to "off". One torch
thread per rank, 2 ranks on 2 cores.

Examples, from the repository root::

    python benchmarks/bench_split.py
    python benchmarks/bench_split.py --seconds 0.1 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    alternate_timed_steps,
    results_config,
    slowest_rank_steps,
    system_info,
    wait_for_quiet,
)
from muon_dtensor.demo.cpu import probe  # noqa: E402

WORLD = 2
CONTENDERS: dict[str, str | int] = {'ns_split="off"': "off", "ns_split=2": 2, 'ns_split="auto"': "auto"}
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_split.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--seconds", type=float, default=0.4, help="one-thread Newton-Schulz of the large matrix (0.4)"
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps per contender (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--timeout", type=float, default=900.0, help="rank timeout, s (900)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def sizes(seconds: float) -> tuple[int, str, dict[str, Any]]:
    """The width w (a multiple of 64) and Newton-Schulz dtype for this CPU: 5 iterations on (w, 4w)
    are 90 w^3 flops."""
    cpu = probe()
    rate = cpu.planning_bf16_gflops if cpu.ns_dtype == torch.bfloat16 else cpu.fp32_gflops
    w = max(64, round((seconds * rate * 1e9 / 90) ** (1 / 3) / 64) * 64)
    return (
        w,
        "bfloat16" if cpu.ns_dtype == torch.bfloat16 else "float32",
        cpu.as_json() | {"kind_text": cpu.describe()},
    )


def shapes_for(w: int) -> list[tuple[int, int]]:
    return [(w, 4 * w)] + [(w // 4, w // 4)] * 4


def _optimizer(shapes: list[tuple[int, int]], ns_dtype: str, split: str | int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muon_dtensor import Muon

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(0)
    params = [
        nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])) for s in shapes
    ]
    for p, s in zip(params, shapes, strict=True):
        p.grad = distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])
    return Muon(params, lr=0.02, ns_dtype=getattr(torch, ns_dtype), ns_split=split)


def rank_contenders(args: argparse.Namespace, w: int, ns_dtype: str) -> dict[str, Any]:
    """Inside a rank: warm every contender up, then alternate timed steps between them."""
    torch.set_num_threads(1)
    opts = {label: _optimizer(shapes_for(w), ns_dtype, split) for label, split in CONTENDERS.items()}
    times = alternate_timed_steps(opts, args.steps, args.warmup)
    return {
        label: {"times": times[label], "collectives": opt.comm_stats.collectives / args.steps}
        for label, opt in opts.items()
    }


def summarize(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for label in CONTENDERS:
        slowest = slowest_rank_steps(per_rank, label)
        rows.append(
            {"contender": label, "median_ms": statistics.median(slowest) * 1e3}
            | {
                "step_ms_slowest_rank": [t * 1e3 for t in slowest],
                "collectives": per_rank[0][label]["collectives"],
            }
        )
    for row in rows:
        row["ratio_to_off"] = row["median_ms"] / rows[0]["median_ms"]
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from benchmarks import bench_split
    from muon_dtensor.testing import run_ranks

    w, ns_dtype, cpu = sizes(args.seconds)
    load = wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    per_rank = run_ranks(bench_split.rank_contenders, WORLD, args, w, ns_dtype, timeout=args.timeout)
    rows = summarize(per_rank)
    print(cpu["kind_text"])
    print(f"matrices {shapes_for(w)}, Newton-Schulz in {ns_dtype}, 2 ranks, FSDP Shard(0)")
    print("| contender | median step ms | ratio to off | collectives per step |\n|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['contender']} | {r['median_ms']:.1f} | {r['ratio_to_off']:.2f} | {r['collectives']:.0f} |"
        )
    print(f"load average at start (1, 5, 15 min): {load['loadavg_1_5_15_min']}; "
          f"run took {time.perf_counter() - started:.0f} s")  # fmt: skip
    config = results_config(args)
    payload = {**system_info(), "config": config, "cpu": cpu, "width": w, "ns_dtype": ns_dtype}
    payload |= {"load_at_start": load, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
