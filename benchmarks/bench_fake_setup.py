"""One rank's optimizer step at 256 to 8,192 ranks, in one process, on torch's ``fake`` backend: the
first step's CPU time (set-up and step) and a steady step's, for Llama-3-8B-shaped matrices (q
4096 x 4096, k and v 1024 x 4096, o 4096 x 4096, w1 and w3 14336 x 4096, w2 4096 x 14336 per layer)
as DTensors holding this rank's real local shard. Layouts: ``fsdp`` (``Shard(0)`` over W ranks),
``hsdp:R`` (R replicas x W / R shards) and ``tp:T`` (W / T FSDP ranks x T TP ranks: ``Shard(0)`` on
both for q, k, v, w1, w3; ``Shard(0)``, ``Shard(1)`` for o, w2).

Times are process time (CPU seconds of this process), so other work on the machine does not count.
The rank measured is the last one by default: with fewer matrices than ranks it owns none, so no
Newton-Schulz runs on it (a rank that owns a 14336 x 4096 matrix runs it on the CPU for real, minutes
in bfloat16 on a CPU without native bfloat16); the results say how many it orthogonalized.
``--revision`` measures a git revision of the package instead of the working tree (each case runs in
a process of its own).

Example, from the repository root::

    python benchmarks/bench_fake_setup.py --out benchmarks/results/fake_setup.json
    python benchmarks/bench_fake_setup.py --revision c4902b5 --cases fsdp:256:2 --out /tmp/before.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_snapshot, results_config, system_info  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
COLWISE = [True, True, True, False, True, True, False]  # q, k, v, o, w1, w3, w2
CASES = [
    "fsdp:256:2", "fsdp:1024:2", "fsdp:1024:8", "fsdp:4096:2", "fsdp:8192:2", "hsdp8:8192:2", "tp8:8192:2",
    "fsdp:1024:80", "fsdp:8192:80", "hsdp8:8192:80", "tp8:8192:80",
]  # fmt: skip


def one(layout: str, world: int, layers: int, rank: int) -> dict[str, Any]:
    """Inside a fresh process: one case's first and steady step, in CPU seconds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from muon_dtensor import Muon

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    if layout == "fsdp":
        mesh, fixed = init_device_mesh("cpu", (world,)), [Shard(0)]
    elif layout.startswith("hsdp"):
        r = int(layout[4:])
        mesh, fixed = init_device_mesh("cpu", (r, world // r)), [Replicate(), Shard(0)]
    else:
        t = int(layout[2:])
        mesh, fixed = init_device_mesh("cpu", (world // t, t)), []
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(layers):
        for shape, colwise in zip(SHAPES, COLWISE):
            placements: list[Placement] = fixed or [Shard(0), Shard(0) if colwise else Shard(1)]
            local_shape, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)

            def local(
                local_shape: Any = local_shape, placements: list = placements, shape: Any = shape
            ) -> Any:
                t = torch.randn(local_shape, generator=gen)
                return DTensor.from_local(
                    t, mesh, placements, shape=torch.Size(shape), stride=(shape[1], 1), run_check=False
                )

            p = torch.nn.Parameter(local())
            p.grad = local()
            params.append(p)
    opt = Muon(params, lr=0.02)
    start = time.process_time()
    opt.step()
    first = time.process_time() - start
    owned = opt.comm_stats.orthogonalized
    start = time.process_time()
    opt.step()
    steady = time.process_time() - start
    dist.destroy_process_group()
    return {"first_s": round(first, 3), "steady_s": round(steady, 4), "orthogonalized": owned}


def run_case(case: str, rank: int | None, source: Path) -> dict[str, Any]:
    layout, world, layers = case.split(":")
    w, n = int(world), int(layers)
    r = w - 1 if rank is None else rank
    name = "fsdp" if layout == "fsdp" else layout
    code = (  # the package from ``source`` first: importing this script puts the working tree on the path
        "import json, sys; sys.path.insert(0, sys.argv[1]); import muon_dtensor;"
        "assert muon_dtensor.__file__.startswith(sys.argv[1]), muon_dtensor.__file__;"
        "sys.path.insert(1, sys.argv[2]); from benchmarks.bench_fake_setup import one;"
        "print(json.dumps(one(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))))"
    )
    env = dict(os.environ, PYTHONPATH=str(source))
    out = subprocess.run(
        [sys.executable, "-c", code, str(source), str(ROOT), name, str(w), str(n), str(r)],
        capture_output=True, text=True, env=env, timeout=3600, check=True,
    )  # fmt: skip
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"case": case, "layout": layout, "world": w, "matrices": 7 * n, "rank": r, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=CASES, help="layout:world:layers, layout fsdp|hsdpR|tpT"
    )
    parser.add_argument("--rank", type=int, help="the rank measured (default: the last)")
    parser.add_argument(
        "--revision", help="a git revision of the package to measure (default: the working tree)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fake_setup.json")
    args = parser.parse_args()
    load = load_snapshot()
    with tempfile.TemporaryDirectory() as tmp:
        source = ROOT
        if args.revision:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.revision, "muon_dtensor"],
                capture_output=True,
                check=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            source = Path(tmp)
        rows: list[dict[str, Any]] = []
        for case in args.cases:
            rows.append(run_case(case, args.rank, source))
            print(json.dumps(rows[-1]), flush=True)
            _write(args, load, rows)  # after each case: a long run stopped early keeps what it measured
    _write(args, load, rows)
    print("| layout | world | matrices | rank | owned | first step CPU s | steady step CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['world']:,} | {r['matrices']} | {r['rank']} | {r['orthogonalized']} "
            f"| {r['first_s']} | {r['steady_s']} |"
        )


def _write(args: argparse.Namespace, load: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    revision = (
        args.revision
        or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    result = {
        "system": system_info(),
        "load_at_start": load,
        "config": results_config(args),
        "revision": revision,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result | {"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
