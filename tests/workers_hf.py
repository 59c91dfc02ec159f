"""A Hugging Face LlamaForCausalLM from a small config (no download), FSDP2 per decoder layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint.safetensors import load_safetensors

BATCH, SEQ = 8, 16


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def build(sharded: bool, seed: int = 0) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config())
    model.config._attn_implementation = "eager"
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def optimizer(model: nn.Module) -> Muon:
    return Muon(split_params(model, adamw_options={"lr": 3e-3}), lr=0.02)


def train(model: nn.Module, opt: Muon, steps: range) -> list[float]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    share = BATCH // world
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        start = torch.randint(0, 64, (BATCH, 1), generator=gen)
        ids = (start + torch.arange(SEQ) * torch.randint(1, 4, (BATCH, 1), generator=gen)) % 64
        ids = ids[rank * share : (rank + 1) * share]
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(float(loss))
    return losses


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def uninterrupted(total: int) -> dict[str, Any]:
    model = build(True)
    opt = optimizer(model)
    return {"losses": train(model, opt, range(total)), "params": full(model)}


def save_part(root: str, split: int) -> dict[str, Any]:
    model = build(True)
    opt = optimizer(model)
    losses = train(model, opt, range(split))
    ckpt.save_checkpoint(root, split, model, opt)
    return {"losses": losses, "params": full(model)}


def resume(root: str, total: int) -> dict[str, Any]:
    model = build(True, seed=5)
    opt = optimizer(model)
    step = ckpt.load_checkpoint(root, model, opt)["step"]
    return {"losses": train(model, opt, range(step, total)), "params": full(model)}


def from_safetensors(folder: str) -> dict[str, torch.Tensor]:
    model = build(True, seed=9)
    load_safetensors(model, folder)
    return full(model)
