"""What the state's zeros cost at construction (issue 50, item 6). ``optim/state.py`` makes each
buffer with ``torch.zeros_like(p)`` on the DTensor parameter: DTensor's dispatch propagates the
sharding, cached per op, shape and placements. The alternative the issue suggests, the zeros made
from what the set-up reads of the layout, is ``DTensor.from_local`` of zeros like the local shard
with the global shape and stride (no propagation). Side by side in one process, one rank of a fake
world of ``--world-sizes``: parameters of distinct shapes (every ``zeros_like`` a cache miss, as
in a test's fresh models) and of a Llama-like set of 7 shapes over many layers (hits after the
first layer, as in a real model). Process time per parameter; each case its own fresh shapes.

    python benchmarks/bench_state_zeros.py --out benchmarks/results/state_zeros.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import results_config, system_info  # noqa: E402

PARAMS = 560  # Llama-3-70B's Muon matrices
_ROWS = itertools.count(4096)  # a fresh first dimension for every distinct shape of the run


def as_torch(p: DTensor) -> torch.Tensor:
    return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)


def from_local(p: DTensor) -> torch.Tensor:
    local = torch.zeros_like(p.to_local(), dtype=torch.float32, memory_format=torch.preserve_format)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def params(mesh: DeviceMesh, distinct: bool) -> list[DTensor]:
    """``PARAMS`` FSDP-sharded matrices: each of its own shape, or 7 shapes repeated by layer."""
    if distinct:
        shapes = [(next(_ROWS), 64) for _ in range(PARAMS)]
    else:
        base = next(_ROWS)
        shapes = [(base + i, 64) for i in range(7)] * (PARAMS // 7)
    return [distribute_tensor(torch.empty(s), mesh, [Shard(0)], src_data_rank=None) for s in shapes]


def per_param_ms(make: Callable[[DTensor], torch.Tensor], ps: list[DTensor]) -> float:
    start = time.process_time()
    for p in ps:
        make(p)
    return (time.process_time() - start) * 1e3 / len(ps)


def measure(world: int) -> dict[str, float]:
    dist.init_process_group("fake", store=FakeStore(), rank=world - 1, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        row: dict[str, float] = {}
        for distinct in (True, False):
            kind = "distinct shapes" if distinct else "7 shapes by layer"
            for name, make in (("zeros_like (the state)", as_torch), ("from_local", from_local)):
                row[f"{name}, {kind}"] = per_param_ms(make, params(mesh, distinct))
        return row
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="1024,8192")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = {int(w): measure(int(w)) for w in args.world_sizes.split(",")}
    columns = list(next(iter(table.values())))
    print(f"ms of CPU per parameter, {PARAMS} parameters a case, one rank of a fake world\n")
    print("| ranks | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for world, row in table.items():
        print(f"| {world:,} | " + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "system": system_info(),
                    "config": {**results_config(args), "params": PARAMS},
                    "ms_per_param": table,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
