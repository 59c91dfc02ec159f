"""Functions that run inside ranks (see tests/distributed.py). Each returns plain data to judge."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from muon_dtensor import Muon

# Uneven rows and columns, fewer rows than ranks (3 and 1 rows at 4 ranks), tall and wide, and
# several same-shape matrices so owners batch them.
SHAPES = [(37, 24), (37, 24), (24, 37), (3, 16), (1, 8), (64, 64), (64, 64), (64, 64), (16, 96)]
ADAMW_SHAPES = [(37,), (10, 8)]


def layouts(world_size: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (mesh shape, placements) for every layout that fits ``world_size``."""
    out: dict[str, tuple[tuple[int, ...], tuple]] = {
        "fsdp": ((world_size,), (Shard(0),)),
        "fsdp_dim1": ((world_size,), (Shard(1),)),
        "replicated": ((world_size,), (Replicate(),)),
    }
    if world_size >= 2:
        out["hsdp"] = ((2, world_size // 2), (Replicate(), Shard(0)))
        out["hsdp_1x"] = ((1, world_size), (Replicate(), Shard(0)))
    return out


def _tensors(seed: int, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = SHAPES + ADAMW_SHAPES
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


def _groups(params: list[torch.Tensor], **muon_kwargs: Any) -> list[dict[str, Any]]:
    n = len(SHAPES)
    return [
        {"params": params[:n], **muon_kwargs},
        {"params": params[n:], "algorithm": "adamw", "lr": 3e-3, "weight_decay": 0.05},
    ]


def reference_step(steps: int, seed: int = 0, **muon_kwargs: Any) -> tuple[list, list]:
    """Parameters and momentum after ``steps`` steps of muon_dtensor.Muon on plain tensors."""
    fulls, grads = _tensors(seed, steps)
    params = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(_groups(params, **muon_kwargs), lr=0.02)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in params[: len(SHAPES)]]
    return [p.detach() for p in params], bufs


def _fit(placements: tuple, ndim: int) -> tuple:
    """Shard a 1-D tensor on dim 0 where the layout shards matrices on dim 1."""
    return tuple(Shard(0) if isinstance(p, Shard) and p.dim >= ndim else p for p in placements)


def sharded_step(mesh_shape, placements, steps: int, seed: int = 0, **muon_kwargs: Any):  # noqa: ANN201
    mesh = init_device_mesh("cpu", mesh_shape)
    fulls, grads = _tensors(seed, steps)
    params = [nn.Parameter(distribute_tensor(f.clone(), mesh, _fit(placements, f.ndim))) for f in fulls]
    opt = Muon(_groups(params, **muon_kwargs), lr=0.02)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = distribute_tensor(g.clone(), mesh, p.placements)
        opt.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in params[: len(SHAPES)]]
    return params, bufs, opt


def _mismatches(sharded: list[DTensor], reference: list[torch.Tensor]) -> list[int]:
    """Indices whose full tensor differs from the reference in any bit."""
    return [i for i, (d, r) in enumerate(zip(sharded, reference)) if not torch.equal(d.full_tensor(), r)]


def exactness(steps: int = 3) -> dict[str, Any]:
    """For every layout and both modes: indices of parameters / momenta that differ bitwise from the
    one-process step, and whether each local momentum is a DTensor like its parameter."""
    world_size = dist.get_world_size()
    out: dict[str, Any] = {}
    for ns_dtype in (torch.bfloat16, torch.float32):
        ref_params, ref_bufs = reference_step(steps, ns_dtype=ns_dtype)
        for name, (mesh_shape, placements) in layouts(world_size).items():
            # "rounds": owner mode pipelined over many small exchange rounds.
            for mode in ("owner", "gather", "rounds"):
                if ns_dtype == torch.float32 and mode != "owner":
                    continue
                extra = {"mode": "owner", "max_round_bytes": 6000} if mode == "rounds" else {"mode": mode}
                params, bufs, opt = sharded_step(mesh_shape, placements, steps, ns_dtype=ns_dtype, **extra)
                key = f"{name}/{mode}/{str(ns_dtype).removeprefix('torch.')}"
                out[key] = {
                    "params": _mismatches(params, ref_params),
                    "momentum": _mismatches(bufs, ref_bufs),
                    "state_like_param": all(
                        isinstance(b, DTensor) and b.placements == p.placements and b.shape == p.shape
                        for b, p in zip(bufs, params)
                    ),
                    "sent": opt.comm_stats.sent,
                    "collectives": opt.comm_stats.collectives,
                }
    return out
