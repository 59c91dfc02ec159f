"""FSDP2 and HSDP models built with fully_shard: exact steps, training, and a DCP resume."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.workers_fsdp import fully_shard_exactness, resume_exactness, train_both


@pytest.mark.parametrize(("world_size", "mesh_shape"), [(1, (1,)), (2, (2,)), (4, (4,)), (4, (2, 2))])
def test_fully_shard_step_equals_single_process(world_size: int, mesh_shape: tuple) -> None:
    for rank, bad in enumerate(run_ranks(fully_shard_exactness, world_size, mesh_shape)):
        assert bad == [], f"rank {rank}: differs from one process at {bad}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_training_tracks_single_process(world_size: int) -> None:
    """Real backward passes: FSDP averages gradients over ranks in another order than one process
    sums them, so this is a float-tolerance check (exactness given equal gradients is tested above)."""
    result = run_ranks(train_both, world_size, (world_size,))[0]
    sharded, single = result["sharded"], result["single"]
    assert single["losses"][-1] < single["losses"][0]
    torch.testing.assert_close(sharded["losses"], single["losses"], rtol=2e-3, atol=2e-3)
    for name, p in single["params"].items():
        # lr 0.02 times a few bfloat16 roundings of the update
        assert (sharded["params"][name] - p).abs().max() <= 2e-3, name


@pytest.mark.parametrize(("world_size", "mesh_shape"), [(2, (2,)), (4, (2, 2))])
def test_dcp_resume_on_same_layout_is_bitwise(world_size: int, mesh_shape: tuple, tmp_path) -> None:
    for rank, bad in enumerate(run_ranks(resume_exactness, world_size, mesh_shape, str(tmp_path / "ckpt"))):
        assert bad == [], f"rank {rank}: {bad}"
