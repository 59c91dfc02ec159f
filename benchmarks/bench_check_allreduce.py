"""What the step's check costs on the CPU backend as ranks grow: one small integer sum (the check's row,
15 int64) over gloo with 2, 4, 8 and 16 local processes, one torch thread each, these ways:

- ``ring``: one all-reduce over every rank (the check up to ``grid.GRID_ABOVE`` ranks). gloo's
  allreduce (``gloo/allreduce.cc``, ``ring``) cuts even a tiny buffer into at least 2 P segments and
  runs a reduce-scatter then an allgather around the ring: 4 (P - 1) sequential hops.
- ``grid``: the check before the butterfly, axis by axis over a grid of sides of at most
  ``--grid-side`` ranks (4 here, 64 in the library then): 4 sum(side - 1) hops.
- ``butterfly``: the library's check above ``GRID_ABOVE`` (forced here): log2 P two-rank steps
  (``sharding/plan/grid.py``), through the library's own ``comm.sum_over_group``.
- ``bf_allgather`` and ``bf_sendrecv``: the same butterfly written out here with each step's transport
  named, so the two can be told apart whichever the library runs: an all-gather over the pair's
  two-rank group (waited in slices, ``failures.wait_released``), or one ``isend`` and one ``irecv``
  on the world group (no pair group; waited without a timeout: a timed-out gloo receive closes its
  pair).
- ``bf_sendrecv_thread``: ``bf_sendrecv`` run on a waiting thread while the caller waits for it in
  slices, as a send/recv butterfly that a failed peer can still release would run.
- ``radix4`` (4 ranks only): one all-gather over the 4 ranks, a radix-4 butterfly's step, to set
  beside the two 2-rank steps of ``bf_allgather`` on the same 4 ranks.

At 2 ranks ``ring`` is the 2-rank all-reduce, ``bf_allgather`` the 2-rank all-gather and
``bf_sendrecv`` the 2-rank send/recv pair: the three methods a butterfly step could be priced as.

Protocol (fixed before the results were seen): per rank count one set of fresh processes; after a
warmup, ``--repeats`` blocks, each running ``--iters`` back-to-back sums of every method in turn, so
the methods share the host's load; a rank's figure per method is its median over all its sums, the
table shows the slowest rank's, and the best single sum. The first butterfly sum creates its pairs
(each by its two ranks): its time is reported apart (``first_ms``). The cost model's hop
(``planning/hardware.GLOO_HOP_SECONDS``) is the best 2-rank all-reduce over its 4 hops. More
processes than cores (2 here, shared with other sessions) oversubscribe the CPU: each hop then waits
for a context switch, so figures above the core count are an upper bound of the per-hop cost, not a
network's. The load average is recorded at the start and end of each rank count. ``--fake-ranks``
also times the creation of the butterfly's pairs for one rank of a fake world of that size (once per
job), in this process.

Example, from the repository root::

    python benchmarks/bench_check_allreduce.py --out benchmarks/results/check_butterfly.json
    python benchmarks/bench_check_allreduce.py --ranks 2 --fake-ranks --out /tmp/pairs.json
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
METHODS = ("ring", "grid", "butterfly", "bf_allgather", "bf_sendrecv", "bf_sendrecv_thread", "radix4")


def _methods(world: int) -> list[str]:
    return [m for m in METHODS if m != "radix4" or world == 4]


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


def _butterflies(rank: int, world: int) -> dict[str, Any]:
    """The butterfly written out with each step's transport named (module docstring)."""
    import torch
    import torch.distributed as dist

    from muon_dtensor.base.compat import all_gather_single
    from muon_dtensor.base.torch_dist import named_group
    from muon_dtensor.sharding.plan import grid
    from muon_dtensor.sharding.runtime.failures import wait_released

    steps = grid.butterfly_steps(world, rank, above=1)
    pairs = {pair: named_group(list(pair), f"bench/pair/{pair[0]}_{pair[1]}") for pair, _ in steps}

    def allgather(t: Any, pair: tuple[int, int]) -> None:
        both = t.new_empty(2 * t.numel())
        wait_released(all_gather_single(both, t, group=pairs[pair], async_op=True), t.device)
        torch.add(both[: t.numel()], both[t.numel() :], out=t)

    def sendrecv(t: Any, pair: tuple[int, int]) -> None:
        other = pair[1] if pair[0] == rank else pair[0]
        got = torch.empty_like(t)
        sent, came = dist.isend(t, dst=other), dist.irecv(got, src=other)
        came.wait()
        sent.wait()
        first, second = (t, got) if rank == pair[0] else (got, t)
        torch.add(first, second, out=t)

    def run(exchange: Any) -> Any:
        def one(row: Any) -> None:
            t = row.clone()
            for pair, adds_nothing in steps:
                if adds_nothing:
                    t.zero_()
                exchange(t, pair)

        return one

    return {
        "bf_allgather": run(allgather),
        "bf_sendrecv": run(sendrecv),
        "bf_sendrecv_thread": _threaded(run(sendrecv)),
    }


def _threaded(one: Any) -> Any:
    """``one`` run whole on a waiting thread while the caller waits for it in slices of the
    library's polling interval, as ``failures.wait_released`` does: what a send/recv butterfly that
    can still be released by a failed peer would cost (two thread hand-offs per sum)."""
    import queue
    import threading

    from muon_dtensor.sharding.runtime.failures import POLL

    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def serve() -> None:
        while True:
            row, done = jobs.get()
            one(row)
            done.set()

    threading.Thread(target=serve, daemon=True).start()

    def run(row: Any) -> None:
        done = threading.Event()
        jobs.put((row, done))
        while not done.wait(POLL.total_seconds()):
            pass

    return run


def _rank(rank: int, world: int, port: int, args: Any, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from muon_dtensor.base.compat import all_gather_single
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

    def radix4() -> None:
        every = row.new_empty(world * ROW)
        wait_released(all_gather_single(every, row, group=world_group, async_op=True), row.device)
        every.view(world, ROW).sum(0)

    above = grid.GRID_ABOVE
    start = time.perf_counter()
    butterfly_sum()  # creates the pairs
    first = time.perf_counter() - start
    run = {"ring": lambda: sum_over_group(row, world_group), "grid": grid_sum, "butterfly": butterfly_sum}
    run.update({m: (lambda f=f: f(row)) for m, f in _butterflies(rank, world).items()})
    run["radix4"] = radix4
    methods = _methods(world)
    for m in methods:
        for _ in range(args.warmup):
            run[m]()
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for m in methods:
            for _ in range(args.iters):
                start = time.perf_counter()
                run[m]()
                times[m].append(time.perf_counter() - start)
    dist.barrier()
    out.put((rank, first, {m: (statistics.median(t), min(t)) for m, t in times.items()}))
    dist.destroy_process_group()


def measure(world: int, args: Any) -> list[dict[str, Any]]:
    """Per method: the slowest rank's median and the fastest single sum, in microseconds, and the
    load average before and after this rank count's run."""
    load_before = os.getloadavg()
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
    from muon_dtensor.sharding.plan import grid

    steps = len(grid.butterfly_steps(world, 0, above=1))
    hops = {"ring": 4 * (world - 1), "grid": sum(4 * (s - 1) for s in sides), "radix4": world - 1}
    loads = {
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    return [
        {
            "ranks": world,
            "method": m,
            "hops": hops.get(m, steps),
            "median_us": round(max(r[2][m][0] for r in results) * 1e6, 1),
            "best_us": round(min(r[2][m][1] for r in results) * 1e6, 1),
            **({"first_ms": round(max(r[1] for r in results) * 1e3, 1)} if m == "butterfly" else {}),
            **loads,
        }
        for m in _methods(world)
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
        "| ranks | method | hops or steps | median sum (us) | best (us) | first sum (ms) | load before, after |\n"
        "|---|---|---:|---:|---:|---:|---|"
    )
    for r in rows:
        print(
            f"| {r['ranks']} | {r['method']} | {r['hops']} | {r['median_us']} | {r['best_us']} | "
            f"{r.get('first_ms', '')} | {r['load_before'][0]}, {r['load_after'][0]} |"
        )
    for c in result["creation_on_fake"]:
        print(f"pairs created on a fake world of {c['ranks']}: {c}")
    print(f"load at start {load['loadavg_1_5_15_min']}, at end {os.getloadavg()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
