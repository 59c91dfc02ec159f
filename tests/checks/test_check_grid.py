"""The check's sum over many ranks runs axis by axis over a grid of subgroups (``sharding/plan/grid.py``,
``runtime.groups.check_groups``): gloo's ring all-reduce takes 4 (P - 1) hops, so at 8,192 ranks one
sum is 32,764 hops (0.66 s at 20 us a hop, ``benchmarks/results/check_allreduce.json``), the grid's 508.
The grid is forced on 4 gloo ranks (2 x 2) here: the step is bitwise the flat one's, and a rank that
differs still raises on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_dtensor import Muon
from muon_dtensor.planning.hardware import GLOO_HOP_SECONDS, Hardware, check_collectives, check_seconds
from muon_dtensor.sharding.plan import grid
from muon_dtensor.sharding.runtime.groups import check_groups
from tests.harness.ranks import run_ranks


def test_grid_factors() -> None:
    assert grid.grid_factors(256) == ()  # one all-reduce up to GRID_ABOVE
    assert grid.grid_factors(8192) == (64, 64, 2)
    assert grid.grid_factors(1024) == (64, 16)
    assert grid.grid_factors(8191) == ()  # prime: no grid, one ring
    assert grid.ring_hops(8192) == 4 * (63 + 63 + 1) and grid.ring_hops(8191) == 4 * 8190
    assert grid.grid_axis((2, 2), 3, 0) == [1, 3] and grid.grid_axis((2, 2), 3, 1) == [2, 3]
    for index in range(24):  # every index is on exactly one line per axis, through itself
        for axis in range(3):
            assert index in grid.grid_axis((2, 3, 4), index, axis)


def test_check_priced_per_backend() -> None:
    gloo, nccl = Hardware.h200(check_backend="gloo"), Hardware.h200()
    assert check_seconds(gloo, 8192) == pytest.approx(508 * GLOO_HOP_SECONDS)
    assert check_seconds(gloo, 256) == pytest.approx(4 * 255 * GLOO_HOP_SECONDS)  # linear up to the grid
    assert check_seconds(nccl, 8192) == nccl.collective_latency
    assert check_collectives(gloo, 8192) == 3 and check_collectives(nccl, 8192) == 1


def _steps(forced: bool, lr_of_rank_1: float = 0.02) -> Any:
    above, side = grid.GRID_ABOVE, grid.GRID_SIDE
    if forced:
        grid.GRID_ABOVE, grid.GRID_SIDE = 1, 2
    try:
        world = dist.group.WORLD
        assert world is not None
        sizes = [dist.get_world_size(g) for g in check_groups(world)]
        mesh = init_device_mesh("cpu", (4,))
        gen = torch.Generator().manual_seed(0)
        p: Any = nn.Parameter(distribute_tensor(torch.randn(12, 8, generator=gen), mesh, [Shard(0)]))
        opt = Muon([p], lr=lr_of_rank_1 if dist.get_rank() == 1 else 0.02)
        for _ in range(2):
            p.grad = distribute_tensor(torch.ones(12, 8), mesh, [Shard(0)])
            try:
                opt.step()
            except ValueError as e:
                return sizes, str(e)
        return sizes, p.full_tensor().flatten().tolist()
    finally:
        grid.GRID_ABOVE, grid.GRID_SIDE = above, side


def test_grid_sum_on_gloo_is_the_flat_sum() -> None:
    flat = run_ranks(_steps, 4, False)
    forced = run_ranks(_steps, 4, True)
    assert [s for s, _ in flat] == [[4]] * 4
    assert [s for s, _ in forced] == [[2, 2]] * 4  # two sums of 2 ranks each
    assert [r for _, r in forced] == [r for _, r in flat]  # bitwise the same step on every rank


def test_grid_sum_still_raises_on_every_rank() -> None:
    results = run_ranks(_steps, 4, True, 0.5)
    assert all(isinstance(r, str) and "'lr'" in r for _, r in results)
