"""The seed bug, reproduced with a test double of the popular round-robin distributed Muon."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from muon_dtensor.demo.round_robin import RoundRobinMuon  # the demo's double, one copy

SHAPES = [(32, 16)] * 8
LR, MOMENTUM = 0.02, 0.95


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _params(sharded: bool) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    if not sharded:
        return [nn.Parameter(f) for f in fulls]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]


def _train(params, opt, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _grads(step)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "placements") else g
        opt.step()


def _full(params) -> list[torch.Tensor]:
    return [p.detach().full_tensor() if hasattr(p, "placements") else p.detach().clone() for p in params]


def round_robin_resume(folder: str, total: int = 6, split: int = 3) -> dict[str, float]:
    """Save rank 0's optimizer.state_dict() as users of round-robin Muon do; resume everywhere."""
    straight = _params(False)
    _train(straight, RoundRobinMuon(straight), range(total))
    params = _params(False)
    opt = RoundRobinMuon(params)
    _train(params, opt, range(split))
    path = Path(folder) / "round_robin.pt"
    if dist.get_rank() == 0:
        torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, path)
    dist.barrier()
    saved = torch.load(path)
    resumed = [nn.Parameter(t.clone()) for t in saved["params"]]
    ropt = RoundRobinMuon(resumed)
    ropt.load_state_dict(saved["optim"])
    kept = sum("momentum_buffer" in s for s in saved["optim"]["state"].values())
    _train(resumed, ropt, range(split, total))
    gap = max(float((a - b).abs().max()) for a, b in zip(_full(resumed), _full(straight)))
    return {"buffers_kept": kept, "buffers": len(SHAPES), "gap": gap}


def muon_dtensor_resume(folder: str, total: int = 6, split: int = 3) -> dict[str, float]:
    straight = _params(True)
    _train(straight, Muon(straight, lr=LR, weight_decay=0.0), range(total))
    params = _params(True)
    opt = Muon(params, lr=LR, weight_decay=0.0)
    _train(params, opt, range(split))
    model = nn.ParameterList(params)
    ckpt.save_checkpoint(folder, split, model, opt)
    resumed = _params(True)
    rmodel = nn.ParameterList(resumed)
    ropt = Muon(resumed, lr=LR, weight_decay=0.0)
    ckpt.load_checkpoint(folder, rmodel, ropt)
    kept = sum(bool(ropt.state[p]["momentum_buffer"].full_tensor().any()) for p in resumed)
    _train(resumed, ropt, range(split, total))
    gap = max(float((a - b).abs().max()) for a, b in zip(_full(resumed), _full(straight)))
    return {"buffers_kept": kept, "buffers": len(SHAPES), "gap": gap}
