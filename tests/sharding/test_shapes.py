"""Replicated parameters, expert stacks, conv and fused weights: each against the one-process step,
bitwise."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from muon_dtensor import Muon
from tests.harness.ranks import run_ranks
from tests.helpers.models import full, step_together

SHAPES = [(24, 40)] * 5 + [(40, 24), (7, 9)]


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


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _data(
    shapes: Sequence[tuple[int, ...]], steps: int
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial values, then full gradients for each step."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in shapes], [
        [torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)
    ]


def _run(params: list[nn.Parameter], grads: list[list[torch.Tensor]], opt: Muon, steps: range) -> None:
    step_together([(params, opt)], lambda step: grads[step], steps)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(full(a).detach(), b.detach())


def _params(fulls: list[torch.Tensor], placements: list | None = None) -> list[nn.Parameter]:
    """Plain parameters, or (placements given) DTensors over all ranks."""
    if placements is None:
        return [nn.Parameter(f.clone()) for f in fulls]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return [nn.Parameter(distribute_tensor(f.clone(), mesh, placements)) for f in fulls]


def reference(
    shapes: Sequence[tuple[int, ...]], steps: int, group_options: dict[str, Any]
) -> tuple[list[nn.Parameter], Muon]:
    fulls, grads = _data(shapes, steps)
    params = _params(fulls)
    opt = Muon([{"params": params, **group_options}], lr=0.02)
    _run(params, grads, opt, range(steps))
    return params, opt


def ddp_replicated(steps: int = 3) -> dict[str, Any]:
    """Plain tensors on every rank, the optimizer given the process group (as under DDP)."""
    ref, ref_opt = reference(SHAPES, steps, {})
    fulls, grads = _data(SHAPES, steps)
    params = _params(fulls)
    opt = Muon(params, lr=0.02, process_group=dist.group.WORLD)
    _run(params, grads, opt, range(steps - 1))
    opt.comm_stats.reset()
    _run(params, grads, opt, range(steps - 1, steps))
    exact = all(_equal(p, q) for p, q in zip(params, ref)) and all(
        torch.equal(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
        for p, q in zip(params, ref)
    )
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # this rank's state_dict alone
    return {"exact": exact, "orthogonalized": opt.comm_stats.orthogonalized, "state": buffer.getvalue()}


def ddp_restore_from_one_rank(state: bytes, steps: int = 3, more: int = 2) -> bool:
    """Load one rank's state_dict on every rank and continue: equals the uninterrupted run."""
    ref, _ = reference(SHAPES, steps + more, {})
    fulls, grads = _data(SHAPES, steps + more)
    params = _params(fulls)
    opt = Muon(params, lr=0.02, process_group=dist.group.WORLD)
    _run(params, grads, Muon(params, lr=0.02), range(steps))  # parameters at `steps`
    opt.load_state_dict(torch.load(io.BytesIO(state)))
    _run(params, grads, opt, range(steps, steps + more))
    return all(_equal(p, q) for p, q in zip(params, ref))


def replicated_dtensor(steps: int = 2) -> dict[str, Any]:
    ref, _ = reference(SHAPES, steps, {})
    fulls, grads = _data(SHAPES, steps)
    params = _params(fulls, [Replicate()])
    opt = Muon(params, lr=0.02)
    _run(params, grads, opt, range(steps))
    return {
        "exact": all(_equal(p, q) for p, q in zip(params, ref)),
        "orthogonalized": opt.comm_stats.orthogonalized,
    }


def experts(dim: int, steps: int = 2) -> dict[str, Any]:
    """Stacked experts [E, m, n] sharded along E (expert parallel, dim 0) or along m (dim 1)."""
    world = dist.get_world_size()
    shapes = [(2 * world, 12, 20), (world + 1, 9, 6)]
    ref, _ = reference(shapes, steps, {"experts": True})
    fulls, grads = _data(shapes, steps)
    params = _params(fulls, [Shard(dim)])
    opt = Muon([{"params": params, "experts": True}], lr=0.02)
    _run(params, grads, opt, range(steps))
    return {
        "exact": all(_equal(p, q) for p, q in zip(params, ref)),
        "sent": opt.comm_stats.sent,
        "orthogonalized": opt.comm_stats.orthogonalized,
    }


def conv_and_fused(steps: int = 2) -> dict[str, bool]:
    """A conv weight (flatten) and a fused q/k/v weight (split_sizes), FSDP-sharded on dim 0."""
    out = {}
    cases: list[tuple[str, list[tuple[int, ...]], dict[str, Any]]] = [
        ("conv", [(10, 3, 3, 3), (6, 10, 1, 1)], {"flatten": True}),
        ("fused", [(8 + 4 + 4 + 1, 16)], {"split_sizes": [8, 4, 4, 1]}),
    ]
    for key, shapes, options in cases:
        ref, _ = reference(shapes, steps, options)
        fulls, grads = _data(shapes, steps)
        params = _params(fulls, [Shard(0)])
        opt = Muon([{"params": params, **options}], lr=0.02)
        _run(params, grads, opt, range(steps))
        out[key] = all(_equal(p, q) for p, q in zip(params, ref))
    return out
