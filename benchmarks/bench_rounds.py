"""Exchange rounds and replicated parameters, side by side in one run, at 2 gloo ranks.

1. Owner mode on FSDP ``Shard(0)`` DTensors with ``max_round_bytes`` None (one round), 16, 4 and
   1 MiB: median step time, ratio to one round, collectives per step, and the peak bytes of live
   exchange buffers per rank (``comm_stats.peak_bytes``): the cap bounds memory and sets the grain
   at which the next round's all-to-all overlaps this round's Newton-Schulz.
2. Replicated plain tensors (DDP) with ``process_group=``: matrices each rank orthogonalizes per
   step (about 1/N) and step time against muon_dtensor in one process.

Examples, from the repository root::

    python benchmarks/bench_rounds.py
    python benchmarks/bench_rounds.py --layers 4 --width 256 --steps 3
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
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import set_shapes, system_info  # noqa: E402
from muon_dtensor import Muon  # noqa: E402
from muon_dtensor.testing import run_ranks  # noqa: E402

CAPS: list[int | None] = [None, 16 << 20, 4 << 20, 1 << 20]


def _params(shapes: list[tuple[int, int]], mesh: Any) -> list[nn.Parameter]:
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    out = []
    for s in shapes:
        t, g = torch.randn(s, generator=gen), torch.randn(s, generator=gen)
        p = nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if mesh is not None else t)
        p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        out.append(p)
    return out


def _time(opt: Muon, steps: int, warmup: int) -> tuple[float, dict[str, int]]:
    for _ in range(warmup):
        opt.step()
    opt.comm_stats.reset()
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    s = opt.comm_stats
    per_step = {"collectives": s.collectives // steps, "orthogonalized": s.orthogonalized // steps}
    return statistics.median(times), {**per_step, "peak_bytes": s.peak_bytes}


def rank_work(shapes: list[tuple[int, int]], steps: int, warmup: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for cap in CAPS:
        out[f"owner, max_round_bytes={cap}"] = _time(
            Muon(_params(shapes, mesh), lr=0.02, max_round_bytes=cap), steps, warmup
        )
    ddp = Muon(_params(shapes, None), lr=0.02, process_group=dist.group.WORLD)
    out["replicated (DDP), process_group=WORLD"] = _time(ddp, steps, warmup)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/bench_rounds.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = set_shapes("default", args.layers, args.width)
    single, single_stats = _time(Muon(_params(shapes, None), lr=0.02), args.steps, args.warmup)
    from benchmarks.bench_rounds import rank_work as importable  # ranks import it by module name

    ranks = run_ranks(importable, 2, shapes, args.steps, args.warmup, timeout=1800)
    base = max(r["owner, max_round_bytes=None"][0] for r in ranks)
    print(
        f"{len(shapes)} matrices; muon_dtensor.Muon in one process: {single * 1e3:.1f} ms, "
        f"{single_stats['orthogonalized']} matrices orthogonalized per step\n"
    )
    print(
        "| contender (2 ranks) | median step ms | vs one round | vs one process | collectives/step | "
        "matrices orthogonalized/rank/step | peak exchange MiB/rank |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for key in ranks[0]:
        ms = max(r[key][0] for r in ranks)
        stats = ranks[0][key][1]
        work = "/".join(str(r[key][1]["orthogonalized"]) for r in ranks)
        peak = max(r[key][1]["peak_bytes"] for r in ranks) / 2**20
        rows.append({"contender": key, "ms": ms * 1e3, "work": work, "peak_mib": peak, **stats})
        print(
            f"| {key} | {ms * 1e3:.1f} | {ms / base:.2f} | {ms / single:.2f} | {stats['collectives']} | {work} | {peak:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({**system_info(), "single_ms": single * 1e3, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
