"""What the step's check costs on the CPU backend as ranks grow: one small integer sum (the check's row,
15 int64) over gloo with 2, 4, 8 and 16 local processes, one torch thread each, three ways:

- ``ring``: one all-reduce over every rank (the check up to ``grid.GRID_ABOVE`` ranks). gloo's
  allreduce (``gloo/allreduce.cc``, ``ring``) cuts even a tiny buffer into at least 2 P segments and
  runs a reduce-scatter then an allgather around the ring: 4 (P - 1) sequential hops.
- ``grid``: the check before the butterfly, axis by axis over a grid of sides of at most
  ``--grid-side`` ranks (4 here, 64 in the library then): 4 sum(side - 1) hops.
- ``butterfly``: the check now above ``GRID_ABOVE`` (forced here): log2 P two-rank all-gathers, one
  hop each (``sharding/plan/grid.py``), through the library's own ``comm.sum_over_group``.

Protocol (fixed before the results were seen): per rank count one set of fresh processes; after a
warmup, ``--repeats`` blocks, each running ``--iters`` back-to-back sums of every method in turn, so
the methods share the host's load; a rank's figure per method is its median over all its sums, the
table shows the slowest rank's, and the best single sum. The first butterfly sum creates its pairs
(each by its two ranks): its time is reported apart (``first_ms``). The cost model's hop
(``planning/hardware.GLOO_HOP_SECONDS``) is the best 2-rank all-reduce over its 4 hops. More
processes than cores (2 here, shared with other sessions) oversubscribe the CPU: each hop then waits
for a context switch, so figures above the core count are an upper bound of the per-hop cost, not a
network's. ``--fake-ranks`` also times the creation of the butterfly's pairs for one rank of a fake
world of that size (once per job), in this process.

Example, from the repository root::

    python benchmarks/bench_check_allreduce.py --out benchmarks/results/check_butterfly.json
"""

from __future__ import annotations

import argparse
import json
import math
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
METHODS = ("ring", "grid", "butterfly")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _grid_lines(world: int, side: int) -> list[list[list[int]]]:
    """Per axis, the lines of the grid before the butterfly (sides at most ``side``, largest first)."""
    factors, rest = [], world
    while rest > 1:
        d = next(d for d in range(min(side, rest), 1, -1) if rest % d == 0)
        factors.append(d)
        rest //= d
    axes = []
    for axis in range(len(factors)):
        stride = math.prod(factors[axis + 1 :])
        starts = sorted({i - (i // stride % factors[axis]) * stride for i in range(world)})
        axes.append([[s + j * stride for j in range(factors[axis])] for s in starts])
    return axes


def _rank(rank: int, world: int, port: int, args: Any, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from muon_dtensor.sharding.plan import grid
    from muon_dtensor.sharding.runtime.comm import sum_over_group
    from muon_dtensor.sharding.runtime.failures import wait_released

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    world_group = dist.group.WORLD
    assert world_group is not None
    lines = []  # every rank creates every line in one order (the first groups of this job)
    for axis in _grid_lines(world, args.grid_side):
        for members in axis:
            g = dist.new_group(members)
            lines += [g] if rank in members else []
    row = torch.ones(ROW, dtype=torch.int64)

    def grid_sum() -> None:
        t = row.clone()
        for g in lines:
            wait_released(dist.all_reduce(t, group=g, async_op=True), t.device)

    def butterfly_sum() -> None:
        grid.GRID_ABOVE = 1
        try:
            sum_over_group(row, world_group)
        finally:
            grid.GRID_ABOVE = above

    above = grid.GRID_ABOVE
    start = time.perf_counter()
    butterfly_sum()  # creates the pairs
    first = time.perf_counter() - start
    run = {"ring": lambda: sum_over_group(row, world_group), "grid": grid_sum, "butterfly": butterfly_sum}
    for fn in run.values():
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for _ in range(args.repeats):
        for m in METHODS:
            for _ in range(args.iters):
                start = time.perf_counter()
                run[m]()
                times[m].append(time.perf_counter() - start)
    dist.barrier()
    out.put((rank, first, {m: (statistics.median(t), min(t)) for m, t in times.items()}))
    dist.destroy_process_group()


def measure(world: int, args: Any) -> list[dict[str, Any]]:
    """Per method: the slowest rank's median and the fastest single sum, in microseconds."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    sides = [len(a[0]) for a in _grid_lines(world, args.grid_side)]
    hops = {"ring": 4 * (world - 1), "grid": sum(4 * (s - 1) for s in sides), "butterfly": 0}
    from muon_dtensor.sharding.plan import grid

    hops["butterfly"] = grid.ring_hops(world, above=1)
    return [
        {
            "ranks": world,
            "method": m,
            "hops": hops[m],
            "median_us": round(max(r[2][m][0] for r in results) * 1e6, 1),
            "best_us": round(min(r[2][m][1] for r in results) * 1e6, 1),
            **({"first_ms": round(max(r[1] for r in results) * 1e3, 1)} if m == "butterfly" else {}),
        }
        for m in METHODS
    ]


def creation_on_fake(world: int) -> dict[str, Any]:
    """CPU seconds to create the butterfly's pairs for rank 0 (and the last rank) of a fake world."""
    import torch.distributed as dist

    from muon_dtensor.base.torch_dist import fake_store
    from muon_dtensor.sharding.runtime.groups import check_groups

    out: dict[str, Any] = {"ranks": world}
    for rank in (0, world - 1):
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
        world_group = dist.group.WORLD
        assert world_group is not None
        start = time.process_time()
        steps = check_groups(world_group)
        out[f"rank_{rank}"] = {
            "pairs": len({id(g) for g, _ in steps}),
            "cpu_ms": (time.process_time() - start) * 1e3,
        }
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--grid-side", type=int, default=4, help="the sides of the grid before the butterfly")
    parser.add_argument("--fake-ranks", type=int, nargs="*", default=[1024, 8192])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/check_butterfly.json")
    args = parser.parse_args()
    load = load_snapshot()
    rows = [row for w in args.ranks for row in measure(w, args)]
    result = {
        "system": system_info(),
        "load_at_start": load,
        "config": results_config(args),
        "rows": rows,
        "creation_on_fake": [creation_on_fake(w) for w in args.fake_ranks],
        "cores": os.cpu_count(),
    }
    print(
        "| ranks | method | hops | median sum (us) | best (us) | first sum (ms) |\n|---|---|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['ranks']} | {r['method']} | {r['hops']} | {r['median_us']} | {r['best_us']} | "
            f"{r.get('first_ms', '')} |"
        )
    for c in result["creation_on_fake"]:
        print(f"pairs created on a fake world of {c['ranks']}: {c}")
    print(f"load at start {load['loadavg_1_5_15_min']}, at end {os.getloadavg()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
