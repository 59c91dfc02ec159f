"""Rank functions for replicated parameters (DDP, replicated DTensors), expert stacks, conv and
fused weights: each against the one-process step, bitwise."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from muon_dtensor import Muon

SHAPES = [(24, 40)] * 5 + [(40, 24), (7, 9)]


def _data(shapes, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes], [
        [torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)
    ]


def _run(params, grads_per_step, opt, place) -> None:
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = place(p, g.clone())
        opt.step()


def _equal(a, b) -> bool:
    a = a.full_tensor() if isinstance(a, DTensor) else a
    return torch.equal(a.detach(), b.detach())


def reference(shapes, steps: int, group_options: dict[str, Any], seed: int = 0):
    fulls, grads = _data(shapes, steps, seed)
    params = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon([{"params": params, **group_options}], lr=0.02)
    _run(params, grads, opt, lambda p, g: g)
    return params, opt


def ddp_replicated(steps: int = 3) -> dict[str, Any]:
    """Plain tensors on every rank, the optimizer given the process group (as under DDP)."""
    ref, ref_opt = reference(SHAPES, steps, {})
    fulls, grads = _data(SHAPES, steps)
    params = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(params, lr=0.02, process_group=dist.group.WORLD)
    _run(params, grads[:-1], opt, lambda p, g: g)
    opt.comm_stats.reset()
    _run(params, grads[-1:], opt, lambda p, g: g)
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
    params = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(params, lr=0.02, process_group=dist.group.WORLD)
    _run(params, grads[:steps], Muon(params, lr=0.02), lambda p, g: g)  # parameters at `steps`
    opt.load_state_dict(torch.load(io.BytesIO(state)))
    _run(params, grads[steps:], opt, lambda p, g: g)
    return all(_equal(p, q) for p, q in zip(params, ref))


def replicated_dtensor(steps: int = 2) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, _ = reference(SHAPES, steps, {})
    fulls, grads = _data(SHAPES, steps)
    params = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Replicate()])) for f in fulls]
    opt = Muon(params, lr=0.02)
    _run(params, grads, opt, lambda p, g: distribute_tensor(g, mesh, [Replicate()]))
    return {
        "exact": all(_equal(p, q) for p, q in zip(params, ref)),
        "orthogonalized": opt.comm_stats.orthogonalized,
    }


def experts(dim: int, steps: int = 2) -> dict[str, Any]:
    """Stacked experts [E, m, n] sharded along E (expert parallel, dim 0) or along m (dim 1)."""
    world = dist.get_world_size()
    shapes = [(2 * world, 12, 20), (world + 1, 9, 6)]
    mesh = init_device_mesh("cpu", (world,))
    ref, ref_opt = reference(shapes, steps, {"experts": True})
    fulls, grads = _data(shapes, steps)
    params = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(dim)])) for f in fulls]
    opt = Muon([{"params": params, "experts": True}], lr=0.02)
    _run(params, grads, opt, lambda p, g: distribute_tensor(g, mesh, [Shard(dim)]))
    return {
        "exact": all(_equal(p, q) for p, q in zip(params, ref)),
        "sent": opt.comm_stats.sent,
        "orthogonalized": opt.comm_stats.orthogonalized,
    }


def conv_and_fused(steps: int = 2) -> dict[str, Any]:
    """A conv weight (flatten) and a fused q/k/v weight (split_sizes), FSDP-sharded on dim 0."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for key, shapes, options in [
        ("conv", [(10, 3, 3, 3), (6, 10, 1, 1)], {"flatten": True}),
        ("fused", [(8 + 4 + 4 + 1, 16)], {"split_sizes": [8, 4, 4, 1]}),
    ]:
        ref, _ = reference(shapes, steps, options)
        fulls, grads = _data(shapes, steps)
        params = [nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])) for f in fulls]
        opt = Muon([{"params": params, **options}], lr=0.02)
        _run(params, grads, opt, lambda p, g: distribute_tensor(g, mesh, [Shard(0)]))
        out[key] = all(_equal(p, q) for p, q in zip(params, ref))
    return out
