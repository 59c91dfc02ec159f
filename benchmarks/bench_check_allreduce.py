"""What the step's check costs on the CPU backend as ranks grow: one small integer all-reduce (the
check's row, 15 int64) over gloo with 2, 4, 8 and 16 local processes, one torch thread each.

gloo's allreduce (``gloo/allreduce.cc``, ``ring``) cuts even a tiny buffer into at least 2 P
segments and runs a reduce-scatter then an allgather around the ring, 2 (2 P - 2) sequential send
and receive steps for P ranks: its latency grows linearly with the rank count. This script
measures it: per rank count, after a warmup, ``--iters`` back-to-back all-reduces; a rank's figure is
its median, the table shows the slowest rank's, and the fit ``a + b (P - 1)`` (microseconds). With
``--grid-side S`` it measures the same sum over the step's grid (``sharding/plan/grid.py``, forced to
sides of at most S ranks) too. The cost model's hop (``planning/hardware.GLOO_HOP_SECONDS``) is the
best 2-rank all-reduce over its 4 hops. More processes than cores (2 here, shared
with other sessions) oversubscribe the CPU: each hop then waits for a context switch, so figures
above the core count are an upper bound of the per-hop cost, not a network's.

Example, from the repository root::

    python benchmarks/bench_check_allreduce.py --out benchmarks/results/check_allreduce.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_snapshot, results_config, system_info  # noqa: E402

ROW = 15  # int64 per scope: the check's row (checks/step_checks._ROW)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, iters: int, warmup: int, side: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from muon_dtensor.sharding.plan import grid
    from muon_dtensor.sharding.runtime.groups import check_groups

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if side:  # the step's grid (sharding/plan/grid.py), forced to sides of at most ``side`` ranks
        grid.GRID_ABOVE, grid.GRID_SIDE = 1, side
    world_group = dist.group.WORLD
    assert world_group is not None
    groups = check_groups(world_group) if side else [world_group]
    row = torch.ones(ROW, dtype=torch.int64)
    for _ in range(warmup):
        for g in groups:
            dist.all_reduce(row, group=g)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for g in groups:
            dist.all_reduce(row, group=g)
        times.append(time.perf_counter() - start)
    dist.barrier()
    out.put((rank, statistics.median(times), min(times)))
    dist.destroy_process_group()


def measure(world: int, iters: int, warmup: int, side: int = 0) -> dict[str, float]:
    """The slowest rank's median and fastest single sum, in microseconds (``side``: over a grid)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, iters, warmup, side, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return {
        "ranks": world,
        "grid_side": side,
        "median_us": round(max(m for _, m, _ in results) * 1e6, 1),
        "best_us": round(min(b for _, _, b in results) * 1e6, 1),
    }


def fit(rows: list[dict[str, float]]) -> dict[str, float]:
    """Least squares ``median_us = a + b (P - 1)``."""
    xs = [r["ranks"] - 1 for r in rows]
    ys = [r["median_us"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"a_us": round(my - b * mx, 1), "b_us_per_rank": round(b, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--grid-side", type=int, default=4, help="also measure each count over a grid of this side (0: not)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/check_allreduce.json")
    args = parser.parse_args()
    load = load_snapshot()
    rows = [measure(w, args.iters, args.warmup) for w in args.ranks]
    grids = [
        measure(w, args.iters, args.warmup, args.grid_side) for w in args.ranks if w > args.grid_side > 0
    ]
    result = {
        "system": system_info(),
        "load_at_start": load,
        "config": results_config(args),
        "rows": rows,
        "grid_rows": grids,
        "fit": fit(rows),
        "cores": os.cpu_count(),
    }
    print("| ranks | median all-reduce (us) | best (us) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['median_us']} | {r['best_us']} |")
    for r in grids:
        print(f"| {r['ranks']} over a grid of side {r['grid_side']} | {r['median_us']} | {r['best_us']} |")
    print(f"fit: {result['fit']}; load at start {load['loadavg_1_5_15_min']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
