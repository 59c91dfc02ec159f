"""Stage layouts of ``tests.helpers.pipeline.Stack`` on 4 (or 2) ranks, for checkpoints that move between
them. Every layout steps on the same synthetic full gradients (seeded by FQN and step, laid out like
each parameter), so each one equals one process bit for bit, TP included (a real TP backward sums
partial products in another order; the library's claim is the step given the same gradients).

- ``stages``: 2 stages (layers 0-1 with the embedding, 2-3 with norm and output) x FSDP2 on 2 ranks;
- ``stages4``: 4 stages of one layer each, one rank each, plain tensors;
- ``hsdp``: 2 stages x HSDP (2 replicas x 1 shard);
- ``tp``: 2 stages x tensor parallel on 2 ranks (column-wise layers; the rest replicated);
- ``merged``: the whole model, FSDP2 over the world (2 ranks), no pipeline.
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from muon_dtensor import Muon, split_params
from tests.helpers.models import distribute_like
from tests.helpers.pipeline import Stack, shard, stack

CUTS = {2: (("0", "1"), ("2", "3")), 4: (("0",), ("1",), ("2",), ("3",))}
Built = tuple[nn.Module, Muon]


def cut(model: Stack, stages: int, stage: int) -> Stack:
    """Stage ``stage`` of ``stages``: a copy of ``model`` with the other stages' modules removed, so
    names stay the whole model's (as torchtitan cuts its models)."""
    out = copy.deepcopy(model)
    for key in [k for k in out.layers if k not in CUTS[stages][stage]]:
        del out.layers[key]
    if stage > 0:
        out.embed = None
    if stage < stages - 1:
        out.norm = out.output = None
    return out


def build(layout: str, seed: int) -> Built:
    """This rank's model part of ``layout`` from ``stack(seed)``, and its Muon."""
    whole = stack(seed)
    if layout == "merged":
        model: nn.Module = shard(whole, init_device_mesh("cpu", (dist.get_world_size(),)))
    elif layout == "stages4":
        init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
        model = cut(whole, 4, dist.get_rank())
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
        model = _fsdp(cut(whole, 2, mesh.get_local_rank("pp")), mesh["replicate", "shard"])
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        part = cut(whole, 2, mesh.get_local_rank("pp"))
        if layout == "tp":
            plan = {f"layers.{k}": ColwiseParallel() for k in part.layers}
            model = parallelize_module(part, mesh["dp"], plan)  # type: ignore[arg-type]
        else:
            model = shard(part, mesh["dp"])
    return model, Muon(split_params(model), lr=0.02)


def _fsdp(model: Stack, mesh: DeviceMesh) -> nn.Module:
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gradient(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * step)
    return torch.randn(shape, generator=gen)


def train(model: nn.Module, opt: Muon, steps: range) -> None:
    """Steps on the synthetic gradients: the same full gradient per FQN and step in every layout."""
    for step in steps:
        opt.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            p.grad = distribute_like(p, gradient(name, tuple(p.shape), step))
        opt.step()
