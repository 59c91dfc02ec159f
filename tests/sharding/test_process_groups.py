"""Process groups the package creates are dropped with the default process group.

Regression: the exchange groups and the checkpoint's save group were cached in module dictionaries
keyed by rank lists, so after ``destroy_process_group`` and a new ``init_process_group`` (a restarted
job in the same process, as elastic agents and notebooks do) the optimizer and save helpers got the
dead groups back. Fresh processes: the rank function destroys its process group.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from muon_dtensor.sharding.runtime import groups
from muon_dtensor.testing import run_ranks


def _sum_over(group: dist.ProcessGroup) -> float:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return float(t)


def restart_in_process(store: str) -> dict[str, Any]:
    """Create the groups, restart the process group, create them again and use them. Axes (0, 1)
    of a 3-D mesh: a new group (all axes of a mesh of every rank would be the default group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1, 1))
    first, first_save = groups.exchange_group(mesh, (0, 1)), groups.save_group(None)
    before = _sum_over(first)
    dist.destroy_process_group()
    del mesh
    gc.collect()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world, 1, 1))
    second, second_save = groups.exchange_group(mesh, (0, 1)), groups.save_group(None)
    dist.barrier(group=second_save)
    gc.collect()
    return {
        "before": before,
        "after": _sum_over(second),
        "new_groups": second is not first and second_save is not first_save,
        "same_when_cached": groups.exchange_group(mesh, (0, 1)) is second,
        "cached_worlds": len(groups._GROUPS),
    }


@pytest.mark.slow
def test_groups_are_recreated_after_the_process_group_restarts(tmp_path: Path) -> None:
    results = run_ranks(restart_in_process, 2, str(tmp_path / "store2"), timeout=90)
    for rank, r in enumerate(results):
        assert r["before"] == r["after"] == 2.0, (rank, r)
        assert r["new_groups"] and r["same_when_cached"], (rank, r)
        assert r["cached_worlds"] == 1, (rank, r)
