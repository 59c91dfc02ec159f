"""Replicated parameters, expert stacks, conv and fused weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muon_dtensor import Muon
from tests.distributed import run_ranks
from tests.workers_shapes import (
    SHAPES,
    conv_and_fused,
    ddp_replicated,
    ddp_restore_from_one_rank,
    experts,
    replicated_dtensor,
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_params_split_the_work_and_any_rank_state_dict_restores(world_size: int) -> None:
    results = run_ranks(ddp_replicated, world_size)
    assert all(r["exact"] for r in results)
    counts = [r["orthogonalized"] for r in results]
    assert sum(counts) == len(SHAPES)  # each matrix once, somewhere
    assert max(counts) <= -(-len(SHAPES) // world_size) + 1  # about 1/N each
    state = results[-1]["state"]  # the last rank's state_dict alone
    assert run_ranks(ddp_restore_from_one_rank, world_size, state) == [True] * world_size


def test_replicated_dtensors_split_the_work() -> None:
    results = run_ranks(replicated_dtensor, 4)
    assert all(r["exact"] for r in results)
    counts = [r["orthogonalized"] for r in results]  # over 2 steps
    assert sum(counts) == 2 * len(SHAPES) and max(counts) <= 2 * (-(-len(SHAPES) // 4) + 1)


@pytest.mark.parametrize("dim", [0, 1], ids=["expert_parallel", "fsdp_rows"])
def test_expert_stacks(dim: int) -> None:
    results = run_ranks(experts, 4, dim)
    assert all(r["exact"] for r in results)
    if dim == 0:
        assert all(r["sent"] == 0 for r in results)  # whole experts stay where they are
    else:
        assert sum(r["orthogonalized"] for r in results) == 2 * (8 + 5)  # each expert once per step


def test_conv_and_fused_weights() -> None:
    assert run_ranks(conv_and_fused, 4) == [{"conv": True, "fused": True}] * 4


def test_conv_without_flatten_says_how() -> None:
    with pytest.raises(ValueError, match=r"'c.weight'.*\"flatten\": True"):
        Muon([("c.weight", nn.Parameter(torch.randn(4, 3, 3, 3)))])


def test_split_sizes_equal_separate_matrices() -> None:
    """A fused [q; k; v] weight with split_sizes steps exactly like three separate weights."""
    gen = torch.Generator().manual_seed(0)
    fused = nn.Parameter(torch.randn(16, 12, generator=gen))
    parts = [nn.Parameter(t.clone()) for t in fused.detach().split([8, 4, 4])]
    a = Muon([{"params": [fused], "split_sizes": [8, 4, 4]}], lr=0.02)
    b = Muon(parts, lr=0.02)
    for _ in range(3):
        g = torch.randn(16, 12, generator=gen)
        fused.grad = g.clone()
        for p, gp in zip(parts, g.split([8, 4, 4])):
            p.grad = gp.clone()
        a.step()
        b.step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in parts]))
    with pytest.raises(ValueError, match="must be positive and sum to its 16 rows"):
        Muon([{"params": [nn.Parameter(torch.randn(16, 12))], "split_sizes": [8, 4]}])
