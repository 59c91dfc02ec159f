"""HSDP 2x2 with owners over the mesh, HSDP 2x2 with owners per replica, and FSDP 4: one Muon step
each, side by side on the same 4 gloo ranks, with the bytes each sends against the formulas.

Contenders, all on ``--layers`` transformer layers of width ``--width`` (bench_step's default set,
seeded gradients set once and stepped repeatedly, ``muon_dtensor.Muon(lr=0.02)`` defaults otherwise):

1. FSDP 4: ``Shard(0)`` on a 1-D mesh of 4 ranks (each matrix orthogonalized once);
2. HSDP 2x2, ``owners="replica"``: ``(Replicate, Shard(0))`` on a (2, 2) mesh, each of the 2
   replica groups orthogonalizes every matrix (the behaviour before owners over the mesh);
3. HSDP 2x2, ``owners="mesh"``: the same layout, each matrix orthogonalized once over the 4 ranks.

Timed steps alternate between the contenders (1, 2, 3, 1, 2, 3, ...) after each one's warmup, so a
change in the machine's load touches all three alike. A step's time is the slowest rank's (a barrier
before each step); the table shows the median. Bytes: ``comm_stats.sent`` per rank per step, split
by destination into bytes within and across replicas, against the formulas of
``muon_dtensor.planning.traffic.py`` (M = all matrices in bf16): FSDP 2 M (N-1) / N^2; HSDP per
replica 2 M (S-1) / S^2 within; HSDP over the mesh (M / N) 2 (S-1) / S within and M (R-1) / N across.
Every rank uses one torch thread; 4 ranks on a 2-core machine time-share the cores, so each step is
about twice its work.

Examples, from the repository root::

    python benchmarks/bench_hsdp.py
    python benchmarks/bench_hsdp.py --layers 4 --width 256 --steps 5
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
from muon_dtensor.planning.costmodel import transformer_shapes  # noqa: E402
from muon_dtensor.planning.traffic import mean_traffic  # noqa: E402

WORLD = 4
# label -> (mesh shape, placements, owners)
CONTENDERS: dict[str, tuple[tuple[int, ...], str, str]] = {
    "FSDP 4": ((4,), "fsdp", "auto"),
    'HSDP 2x2, owners="replica"': ((2, 2), "hsdp", "replica"),
    'HSDP 2x2, owners="mesh"': ((2, 2), "hsdp", "mesh"),
}
GOAL = 1.15  # goal: HSDP within 1.15x of FSDP's step
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_hsdp.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="transformer layers (4)")
    p.add_argument("--width", type=int, default=512, help="model width (512)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per contender (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--timeout", type=float, default=900.0, help="rank timeout, s (900)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def _tensors(shapes: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) * 0.02 for s in shapes], [
        torch.randn(s, generator=gen) for s in shapes
    ]


def _optimizer(mesh_shape: tuple[int, ...], kind: str, owners: str, shapes: list[tuple[int, int]]) -> Any:
    """A Muon over fresh DTensors of ``shapes`` laid out as ``kind``, with gradients set."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muon_dtensor import Muon

    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if kind == "fsdp" else [Replicate(), Shard(0)]
    fulls, grads = _tensors(shapes)
    params = [nn.Parameter(distribute_tensor(f, mesh, placements)) for f in fulls]
    for p, g in zip(params, grads, strict=True):
        p.grad = distribute_tensor(g, mesh, placements)
    return Muon(params, lr=0.02, owners=owners)


def rank_contenders(args: argparse.Namespace) -> dict[str, Any]:
    """Inside a rank: warm every contender up, then alternate timed steps between them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    shapes = transformer_shapes(args.layers, args.width)
    opts = {label: _optimizer(m, kind, owners, shapes) for label, (m, kind, owners) in CONTENDERS.items()}
    times = alternate_timed_steps(opts, args.steps, args.warmup)
    replica = dist.get_rank() // 2  # (2, 2) mesh: ranks 0, 1 are replica 0
    out: dict[str, Any] = {}
    for label, opt in opts.items():
        s = opt.comm_stats
        within = sum(v for d, v in s.sent_to.items() if d // 2 == replica or label == "FSDP 4")
        out[label] = {
            "times": times[label],
            "sent": s.sent / args.steps,
            "sent_within": within / args.steps,
            "sent_across": (s.sent - within) / args.steps,
            "orthogonalized": s.orthogonalized / args.steps,
        }
    return out


def formulas(shapes: list[tuple[int, int]]) -> dict[str, tuple[float, float]]:
    """Mean bytes per rank per step (within, across replicas) for each contender."""
    m = 2.0 * sum(r * c for r, c in shapes)
    labels = list(CONTENDERS)
    return {
        labels[0]: mean_traffic(m, 1, WORLD, "replica"),
        labels[1]: mean_traffic(m, 2, 2, "replica"),
        labels[2]: mean_traffic(m, 2, 2, "mesh"),
    }


def summarize(per_rank: list[dict[str, Any]], shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """One row per contender: median of the slowest rank's step, bytes against the formula."""
    expected = formulas(shapes)
    rows = []
    for label in CONTENDERS:
        slowest = slowest_rank_steps(per_rank, label)
        mean = {k: sum(r[label][k] for r in per_rank) / WORLD for k in ("sent", "sent_within", "sent_across")}
        rows.append(
            {"contender": label, "median_ms": statistics.median(slowest) * 1e3}
            | {"step_ms_slowest_rank": [t * 1e3 for t in slowest], "mean_bytes": mean}
            | {"each_rank": [r[label] for r in per_rank], "formula_within_across": expected[label]}
            | {"orthogonalized_all_ranks": sum(r[label]["orthogonalized"] for r in per_rank)}
        )
    fsdp = rows[0]["median_ms"]
    for row in rows:
        row["ratio_to_fsdp"] = row["median_ms"] / fsdp
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| contender | median step ms | ratio to FSDP 4 | matrices orthogonalized (all ranks) "
        "| bytes sent/rank/step within, across replicas | formula within, across |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, (fw, fa) = r["mean_bytes"], r["formula_within_across"]
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.1f} | {r['ratio_to_fsdp']:.2f} "
            f"| {r['orthogonalized_all_ranks']:.0f} | {b['sent_within']:,.0f}, {b['sent_across']:,.0f} "
            f"| {fw:,.0f}, {fa:,.0f} |"
        )
    return "\n".join(lines)


def checks(rows: list[dict[str, Any]], matrices: int) -> dict[str, bool]:
    by = {r["contender"]: r for r in rows}
    mesh, replica = by['HSDP 2x2, owners="mesh"'], by['HSDP 2x2, owners="replica"']
    exact = all(
        (r["mean_bytes"]["sent_within"], r["mean_bytes"]["sent_across"]) == r["formula_within_across"]
        for r in rows
    )
    return {
        f'HSDP owners="mesh" within {GOAL}x of FSDP 4': mesh["ratio_to_fsdp"] <= GOAL,
        'owners="mesh" faster than owners="replica"': mesh["median_ms"] < replica["median_ms"],
        "mean bytes equal the formulas": exact,
        'owners="mesh" orthogonalizes each matrix once': mesh["orthogonalized_all_ranks"] == matrices,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from benchmarks import bench_hsdp
    from muon_dtensor.testing import run_ranks

    shapes = transformer_shapes(args.layers, args.width)
    load = wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    per_rank = run_ranks(bench_hsdp.rank_contenders, WORLD, args, timeout=args.timeout)
    rows = summarize(per_rank, shapes)
    verdict = checks(rows, len(shapes))
    print(format_table(rows))
    print(
        f"{len(shapes)} matrices, M = {2 * sum(r * c for r, c in shapes):,} bytes in bf16; 4 ranks on {os.cpu_count()} cores"
    )
    print("; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in verdict.items()))
    print(f"load average at start (1, 5, 15 min): {load['loadavg_1_5_15_min']}, other Python processes: "
          f"{load['other_python_processes']}; run took {time.perf_counter() - started:.0f} s")  # fmt: skip
    config = results_config(args)
    payload = {**system_info(), "config": config, "load_at_start": load, "rows": rows, "checks": verdict}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
