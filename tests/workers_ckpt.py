"""Rank functions for checkpoint tests: resume across layouts, bytes per rank, faults."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.workers_fsdp import Net, _apply, _full, _grads, build


def _mesh_shape(layout: str) -> tuple[int, ...]:
    world = dist.get_world_size()
    return (2, world // 2) if layout == "hsdp" else (world,)


def _run(model: nn.Module, opt: Muon, steps: range) -> None:
    """Steps with synthetic full gradients that do not depend on the layout."""
    for step in steps:
        _apply(model, _grads(model, step))
        opt.step()


def _snapshot(model: nn.Module, opt: Muon) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": _full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            out[f"{key}:{n}"] = _full(value).clone()
    return out


def save_after(layout: str, root: str, steps: int) -> dict[str, torch.Tensor]:
    model = build(_mesh_shape(layout))
    opt = Muon(split_params(model), lr=0.02)
    _run(model, opt, range(steps))
    ckpt.save_checkpoint(root, steps, model, opt, extra={"data_position": steps * 8})
    return _snapshot(model, opt)


def resume_and_finish(layout: str, root: str, total: int) -> dict[str, Any]:
    model = build(_mesh_shape(layout), seed=7)  # other initial values: the load must replace them
    opt = Muon(split_params(model), lr=0.02)
    extra = ckpt.load_checkpoint(root, model, opt)
    loaded = _snapshot(model, opt)
    _run(model, opt, range(extra["step"], total))
    return {"extra": extra, "loaded": loaded, "final": _snapshot(model, opt)}


def uninterrupted(total: int) -> dict[str, torch.Tensor]:
    model = build(None)
    opt = Muon(split_params(model), lr=0.02)
    _run(model, opt, range(total))
    return _snapshot(model, opt)


def bytes_per_rank(root: str) -> dict[str, int]:
    """Save Muon state of 256x256 matrices (plus a 3-row one) and report this rank's file bytes."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256, bias=False) for _ in range(6)), nn.Linear(256, 3, bias=False))
    for i, layer in enumerate(model):
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        model[i] = layer
    opt = Muon(model.named_parameters())
    _, optim_sd = get_state_dict(model, opt)
    dcp.save({"optim": optim_sd}, checkpoint_id=root)
    rank = dist.get_rank()
    mine = sum(p.stat().st_size for p in Path(root).glob(f"__{rank}_*.distcp"))
    state = sum(
        v.to_local().numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, DTensor)
    )
    return {"file_bytes": mine, "local_state_bytes": state}


def crash_during_save(root: str) -> None:
    """Step 2 is saved normally; rank 1 dies while step 4 is being written (after its shards are
    on disk, before the checkpoint is published)."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)
    _run(model, opt, range(2))
    ckpt.save_checkpoint(root, 2, model, opt)
    _run(model, opt, range(2, 4))
    if dist.get_rank() == 1:

        def die(path: Path) -> dict[str, int]:
            os._exit(17)

        ckpt.file_record = die  # type: ignore[assignment]
    ckpt.save_checkpoint(root, 4, model, opt)


def load_expecting_error(root: str, kind: str) -> tuple[str, str, bool]:
    """Load into a model that ``kind`` makes incompatible; report the error and whether the model
    was left untouched."""
    torch.manual_seed(3)
    if kind == "other_model":
        model: nn.Module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    elif kind == "shape":
        model = Net()
        model.layers[3] = nn.Linear(24, 25)  # 25 rows where 24 were saved
        model = build_like(model)
    else:
        model = build((dist.get_world_size(),))
    groups = split_params(model)
    if kind == "groups":
        groups = [{"params": [(n, p) for g in groups for n, p in g["params"]], "algorithm": "adamw"}]
    opt = Muon(groups, lr=0.02)
    before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    try:
        ckpt.load_checkpoint(root, model, opt)
    except Exception as e:  # noqa: BLE001
        after = {n: _full(p.detach()) for n, p in model.named_parameters()}
        untouched = all(torch.equal(before[n], after[n]) for n in before)
        return type(e).__name__, str(e), untouched
    return "none", "", True


def build_like(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def state_init_through_dcp() -> dict[str, Any]:
    """DCP's get_state_dict steps an optimizer without state (zero gradients, lr 0): that step must
    take the same collective path on every rank, change no parameter and create every state key."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)
    opt.state.clear()
    before = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    _, optim_sd = get_state_dict(model, opt)
    after = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return {
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
        "keys": sorted({k for s in optim_sd["state"].values() for k in s}),
        "params_with_state": len(optim_sd["state"]),
        "params": len(before),
        "lr_restored": opt.param_groups[0]["lr"] == 0.02,
    }


def async_save_while_training(root: str) -> bool:
    """Start an async save at step 2, train two more steps while it runs, then check that the
    published checkpoint holds step 2's state exactly."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)
    _run(model, opt, range(2))
    at_two = _snapshot(model, opt)
    pending = ckpt.async_save_checkpoint(root, 2, model, opt)
    _run(model, opt, range(2, 4))
    pending.wait()
    fresh = build((dist.get_world_size(),), seed=4)
    fresh_opt = Muon(split_params(fresh), lr=0.02)
    ckpt.load_checkpoint(root, fresh, fresh_opt)
    loaded = _snapshot(fresh, fresh_opt)
    return all(torch.equal(loaded[k], v) for k, v in at_two.items())
