"""Rank functions for FSDP2 (fully_shard) models: exactness, training, checkpoints, bad input."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from muon_dtensor import Muon, split_params


class Net(nn.Module):
    """Uneven widths; 3 and 1 rows give empty shards at 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.layers = nn.ModuleList(
            [nn.Linear(16, 37), nn.Linear(37, 3), nn.Linear(3, 24), nn.Linear(24, 24), nn.Linear(24, 1)]
        )
        self.lm_head = nn.Linear(1, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.lm_head(h)


def build(mesh_shape: tuple[int, ...] | None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    if mesh_shape is not None:
        names = ("dp",) if len(mesh_shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _apply(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        g = grads[name].clone()
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def _mismatched(model: nn.Module, opt: Muon, ref: nn.Module, ref_opt: Muon) -> list[str]:
    ref_params = dict(ref.named_parameters())
    bad = []
    for name, p in model.named_parameters():
        q = ref_params[name]
        if not torch.equal(_full(p.detach()), _full(q.detach())):
            bad.append(name)
        for key, value in opt.state[p].items():
            if not torch.equal(_full(value), _full(ref_opt.state[q][key])):
                bad.append(f"{name}:{key}")
    return bad


def fully_shard_exactness(mesh_shape: tuple[int, ...], steps: int = 3) -> list[str]:
    """fully_shard (FSDP or HSDP) parameters stepped with the same full gradients as one process."""
    model, ref = build(mesh_shape), build(None)
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    for step in range(steps):
        grads = _grads(ref, step)
        _apply(model, grads)
        _apply(ref, grads)
        opt.step()
        ref_opt.step()
    return _mismatched(model, opt, ref, ref_opt)


def _batch(step: int, rank: int, world: int, per_rank: int) -> torch.Tensor:
    """Learnable data: each sequence counts up by a stride of 1 or 2 from a random start, mod 11."""
    gen = torch.Generator().manual_seed(step)
    starts = torch.randint(0, 11, (world * per_rank, 1), generator=gen)
    strides = torch.randint(1, 3, (world * per_rank, 1), generator=gen)
    tokens = (starts + strides * torch.arange(8)) % 11
    return tokens[rank * per_rank : (rank + 1) * per_rank]


def _train_step(model: nn.Module, opt: Muon, tokens: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    return float(loss.detach())


def train(mesh_shape: tuple[int, ...] | None, steps: int = 8, per_rank: int = 8) -> dict[str, Any]:
    """Train with real backward passes; the loss is the mean over all ranks' data."""
    world = dist.get_world_size() if mesh_shape is not None else 1
    rank = dist.get_rank() if mesh_shape is not None else 0
    total = (dist.get_world_size() if dist.is_initialized() else 1) * per_rank
    model = build(mesh_shape)
    opt = Muon(split_params(model), lr=0.02)
    losses = []
    for step in range(steps):
        tokens = _batch(step, rank, world, total // world)
        loss = torch.tensor(_train_step(model, opt, tokens))
        if mesh_shape is not None:
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    return {"losses": losses, "params": {n: _full(p.detach()) for n, p in model.named_parameters()}}


def train_both(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    return {"sharded": train(mesh_shape), "single": train(None)}


def resume_exactness(mesh_shape: tuple[int, ...], path: str, total: int = 4, split: int = 2) -> list[str]:
    """Train ``split`` steps, save with DCP, load into a fresh model and optimizer, train to ``total``:
    everything equals the uninterrupted run bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    straight = build(mesh_shape)
    straight_opt = Muon(split_params(straight), lr=0.02)
    first = build(mesh_shape)
    first_opt = Muon(split_params(first), lr=0.02)
    for step in range(total):
        _train_step(straight, straight_opt, _batch(step, rank, world, 4))
    for step in range(split):
        _train_step(first, first_opt, _batch(step, rank, world, 4))
    model_sd, optim_sd = get_state_dict(first, first_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    resumed = build(mesh_shape, seed=1)
    resumed_opt = Muon(split_params(resumed), lr=0.02)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    bad = [f"after load: {m}" for m in _mismatched(resumed, resumed_opt, first, first_opt)]
    for step in range(split, total):
        _train_step(resumed, resumed_opt, _batch(step, rank, world, 4))
    return bad + _mismatched(resumed, resumed_opt, straight, straight_opt)
