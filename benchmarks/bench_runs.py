"""An owner's copies for one matrix, block by block against strided runs, side by side in one run.

On n row-sharded ranks the owner of a matrix assembles it from n - 1 received blocks and packs its
result back as n - 1 blocks. The step used to copy block by block; ``sharding/plan/runs.py`` merges
equal row blocks at a fixed stride into a few strided copies. This times both on the real routes
(``routes.build_routes``) and the exchange's own copy helpers, in one process without collectives
(the copies are the same whatever moves the buffers): a Llama-3-8B MLP-shaped matrix scaled to
rows = 4 n (fp32, 4 rows per rank as 4096 rows give at 1,024 ranks), one torch thread.

Examples, from the repository root::

    python benchmarks/bench_runs.py
    python benchmarks/bench_runs.py --ranks 64,1024 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import system_info  # noqa: E402
from muon_dtensor.planning.plans import sharded_plan  # noqa: E402
from muon_dtensor.sharding.plan.blocks import block_numel  # noqa: E402
from muon_dtensor.sharding.plan.routes import RoundRoute, build_routes  # noqa: E402
from muon_dtensor.sharding.runtime.exchange import _assemble, _cut, _run_views  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "bench_runs.json"


def _blockwise(route: RoundRoute, recv: Tensor, full: Tensor, send: Tensor) -> None:
    segments = recv.split(list(route.inbound.recv_numels))
    for _, src, offset, block in route.inbound.received:
        _assemble(full, block, segments[src][offset : offset + block_numel(block)])
    offset = 0
    for per_dest in route.outbound.sends:
        for _, block in per_dest:
            piece = _cut(full, block)
            send[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
            offset += piece.numel()


def _by_runs(route: RoundRoute, recv: Tensor, full: Tensor, send: Tensor) -> None:
    for run in route.inbound.runs:
        pieces, rows = _run_views(recv, full, run)
        rows.copy_(pieces)
    for run in route.outbound.send_runs:
        pieces, rows = _run_views(send, full, run)
        pieces.copy_(rows)


def _median_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(n: int, cols: int, repeats: int) -> dict[str, Any]:
    plan = sharded_plan([(4 * n, cols)], n)
    owner = plan.rounds[0].owners[0]
    route = build_routes(plan, owner)[0]
    recv = torch.randn(sum(route.inbound.recv_numels))
    full, send = torch.empty(4 * n, cols), torch.empty(sum(route.outbound.send_numels))
    blockwise = _median_ms(lambda: _blockwise(route, recv, full, send), repeats)
    packed = send.clone()
    runs = _median_ms(lambda: _by_runs(route, recv, full, send), repeats)
    assert torch.equal(packed, send), "runs pack what the block copies pack"
    copies = len(route.inbound.received) + sum(len(d) for d in route.outbound.sends)
    merged = len(route.inbound.runs) + len(route.outbound.send_runs)
    return {
        "ranks": n,
        "copies_blockwise": copies,
        "copies_runs": merged,
        "blockwise_ms": blockwise,
        "runs_ms": runs,
        "speedup": blockwise / runs,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="64,256,1024", help="comma-separated group sizes")
    p.add_argument("--cols", type=int, default=1024, help="columns of the matrix (1024)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(int(n), args.cols, args.repeats) for n in args.ranks.split(",")]
    print("| ranks | copies block by block | copies in runs | block by block ms | runs ms | speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['ranks']:,} | {r['copies_blockwise']:,} | {r['copies_runs']} | {r['blockwise_ms']:.2f} | "
            f"{r['runs_ms']:.3f} | {r['speedup']:.0f}x |"
        )
    payload = {"system": system_info(), "cols": args.cols, "rows": rows}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
