"""Per-head orthogonalization: ``"head_dim": d`` orthogonalizes each head's block of d
rows on its own, alone or within the row blocks of ``split_sizes`` (a fused q, k, v). A parameter
stepped that way equals, bit for bit, its heads stepped as separate parameters, in one process and
under every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from muon_dtensor import Muon
from tests.harness.ranks import run_ranks
from tests.helpers.models import full

D = 4  # head_dim
HIDDEN = 12


def heads_of(rows: int) -> list[tuple[int, int]]:
    return [(lo, lo + D) for lo in range(0, rows, D)]


def step_both(
    weight: torch.Tensor, options: dict[str, Any], steps: int, place: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` stepped with ``options`` (placed by ``place``), and its heads stepped as separate
    parameters in one process, with the same gradients; both as full tensors."""
    fused = torch.nn.Parameter(place(weight) if place else weight.clone())
    heads = [torch.nn.Parameter(weight[lo:hi].clone()) for lo, hi in heads_of(weight.shape[0])]
    opt = Muon([{"params": [fused], **options}], lr=0.02)
    ref = Muon(heads, lr=0.02)
    for step in range(steps):
        grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))
        fused.grad = place(grad) if place else grad
        for p, (lo, hi) in zip(heads, heads_of(weight.shape[0])):
            p.grad = grad[lo:hi].clone()
        opt.step()
        ref.step()
    return full(fused.detach()), torch.cat([p.detach() for p in heads])


@pytest.mark.parametrize(
    "rows, options",
    [(5 * D, {"head_dim": D}), (8 * D, {"head_dim": D, "split_sizes": [4 * D, 2 * D, 2 * D]})],
)
def test_heads_equal_separate_matrices_in_one_process(rows: int, options: dict[str, Any]) -> None:
    got, want = step_both(torch.randn(rows, HIDDEN), options, steps=3)
    assert torch.equal(got, want)


def test_heads_differ_from_the_whole_matrix() -> None:
    """The option changes the maths (so the equality above is not vacuous)."""
    weight = torch.randn(4 * D, HIDDEN)
    got, want = step_both(weight, {}, steps=1)
    assert not torch.equal(got, want)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"head_dim": 3}, "head_dim 3 does not divide the row blocks"),
        ({"head_dim": D, "split_sizes": [6, 14]}, "does not divide the row blocks [6, 14]"),
        ({"head_dim": 0}, "must be a positive int"),
        ({"head_dim": True}, "must be a positive int"),
    ],
)
def test_bad_head_dim_names_the_parameter(options: dict[str, Any], error: str) -> None:
    p = torch.nn.Parameter(torch.randn(5 * D, HIDDEN))
    with pytest.raises(ValueError, match="param_groups\\[0\\]") as info:
        Muon([{"params": [p], **options}])
    assert error in str(info.value)


def sharded_heads(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> bool:
    mesh = init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(1)
    weight = torch.randn(8 * D + 0, HIDDEN + 1)  # uneven over the ranks in both dims
    options = {"head_dim": D, "split_sizes": [4 * D, 2 * D, 2 * D]}
    got, want = step_both(weight, options, 3, lambda t: distribute_tensor(t, mesh, list(placements)))
    return bool(torch.equal(got, want)) and dist.get_world_size() == mesh.size()


@pytest.mark.parametrize(
    "world, mesh_shape, placements",
    [
        (2, (2,), (Shard(0),)),
        (2, (2,), (Shard(1),)),
        (4, (4,), (Shard(0),)),
        (4, (2, 2), (Shard(0), Shard(1))),
        (4, (2, 2), (Replicate(), Shard(0))),
    ],
)
def test_sharded_heads_equal_separate_matrices(
    world: int, mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    assert all(run_ranks(sharded_heads, world, mesh_shape, placements, timeout=120))
