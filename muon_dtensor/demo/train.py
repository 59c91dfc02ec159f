"""Training loop shared by the demo: FSDP2-shard a TinyLM, one muon_dtensor optimizer, N steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, split_params

from .data import batch, corpus, tokens
from .model import ModelConfig, TinyLM

BATCH = 16
LR = 0.02


def make_mesh(layout: str) -> DeviceMesh:
    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if layout == "hsdp" and world % 2 == 0 and world >= 4:
        return init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (world,), mesh_dim_names=("dp",))


def build(cfg: ModelConfig, mesh: DeviceMesh | None) -> tuple[nn.Module, Muon]:
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if mesh is not None:
        model.to(mesh.device_type)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = Muon(split_params(model, adamw_options={"lr": 3e-3, "weight_decay": 0.0}), lr=LR)
    return model, opt


def step(model: nn.Module, opt: Muon, data: torch.Tensor, index: int, rank: int, world: int) -> float:
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    device = next(model.parameters()).device
    full = batch(data, index, BATCH, cfg.seq)
    share = BATCH // world
    local = full[rank * share : (rank + 1) * share].to(device)
    opt.zero_grad(set_to_none=True)
    loss = model.loss(local)
    loss.backward()
    opt.step()
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return float(loss)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
        for n, p in model.named_parameters()
    }


def train_sharded(steps: int, layout: str = "fsdp") -> dict[str, Any]:
    """Rank function: train ``steps`` steps on every rank; rank 0's result carries the losses."""
    mesh = make_mesh(layout)
    model, opt = build(ModelConfig(), mesh)
    data = tokens(corpus())
    losses = [step(model, opt, data, i, dist.get_rank(), dist.get_world_size()) for i in range(steps)]
    return {"losses": losses, "params": full_params(model)}


def train_single(steps: int) -> dict[str, Any]:
    model, opt = build(ModelConfig(), None)
    data = tokens(corpus())
    losses = [step(model, opt, data, i, 0, 1) for i in range(steps)]
    return {"losses": losses, "params": full_params(model)}
