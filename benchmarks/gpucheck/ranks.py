"""(e) With 2+ GPUs: the sharded step against one process, bitwise, and no host sync.

One rank per GPU (in the dry run, 2 gloo CPU ranks), started by ``muon_dtensor.testing.run_ranks`` (its worker calls
``init_process_group("cpu:gloo,cuda:nccl")``: NCCL for CUDA tensors, gloo for the checks' small
host sums). On every rank: part (c)'s model, its parameters broadcast from rank 0, once whole (the
one-process run) and once ``fully_shard``-ed per layer and at the root on a 1-D mesh (FSDP2) or a
(2, world / 2) mesh (HSDP); both step with the same broadcast gradients and an lr that changes every
step, under ``MUON_DTENSOR_NS_BATCH=auto`` (CUDA batches an owner's same-shape matrices, one
process batches all of them) and ``never`` (every matrix alone: the exact mode). Then every
parameter and momentum buffer, gathered, is compared bit for bit, one more steady step runs under
``torch.cuda.set_sync_debug_mode("error")``, and a few steps are timed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from benchmarks.gpucheck.common import Dims, Settings, Skipped, compare, error_text
from benchmarks.gpucheck.step import LR, WEIGHT_DECAY, copy_model, make_model, sync_check, time_steps
from muon_dtensor import Muon, split_params
from muon_dtensor.numerics.newton_schulz import BATCH_ENV

STEPS = 3


def meshes(world: int) -> dict[str, tuple[int, ...]]:
    return {"fsdp": (world,)} | ({"hsdp": (2, world // 2)} if world % 2 == 0 else {})


def shard(model: torch.nn.Module, mesh_shape: tuple[int, ...], device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("dp",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=names)
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def set_grads(ref: torch.nn.Module, sharded: torch.nn.Module, seed: int) -> None:
    """The same random full gradients (rank 0's, broadcast) on both models."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    params = list(ref.parameters())
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    q: Any  # a DTensor parameter
    for p, q in zip(params, sharded.parameters()):
        g = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
        dist.broadcast(g, 0)
        p.grad = g
        q.grad = distribute_tensor(g.clone(), q.device_mesh, q.placements)


def compared(ref: torch.nn.Module, sharded: torch.nn.Module, opts: list[Muon]) -> dict[str, Any]:
    """Every parameter and momentum buffer, gathered, against the one-process run."""
    rows = {}
    q: Any  # a DTensor parameter
    for (name, q), p in zip(sharded.named_parameters(), ref.parameters()):
        rows[name] = compare(p, q.full_tensor())
        mine, theirs = opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"]
        rows[f"{name}:momentum_buffer"] = compare(mine, theirs.full_tensor())
    unequal = {k: v["max_abs_diff"] for k, v in rows.items() if not v["equal"]}
    return {"tensors": len(rows), "bitwise_equal": not unequal, "unequal": unequal}


def run_mesh(mesh_shape: tuple[int, ...], layers: int, dims: Dims, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    ref = make_model(layers, dims, device)
    for p in ref.parameters():
        dist.broadcast(p.data, 0)
    sharded = copy_model(ref)
    shard(sharded, mesh_shape, device)
    opts = [Muon(split_params(m), lr=LR, weight_decay=WEIGHT_DECAY) for m in (ref, sharded)]
    for k in range(STEPS):
        set_grads(ref, sharded, 10 + k)
        for opt in opts:
            for group in opt.param_groups:
                group["lr"] = LR * (1.0 - 0.05 * k)
            opt.step()
    out = compared(ref, sharded, opts)
    set_grads(ref, sharded, 99)
    out["sync_check"] = sync_check(opts[1].step, device)
    out["sharded_step"] = time_steps(opts[1].step, 3, device)
    return out


def rank_check(layers: int, dims: Dims, mesh_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Inside a rank: every mesh under both batch settings."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    out: dict[str, Any] = {}
    for label, mesh_shape in mesh_shapes.items():
        for mode in ("auto", "never"):
            os.environ[BATCH_ENV] = mode
            try:
                out[f"{label} {mesh_shape}, {BATCH_ENV}={mode}"] = run_mesh(mesh_shape, layers, dims, device)
            except Exception as exc:  # noqa: BLE001 - recorded; every rank runs the same code
                out[f"{label} {mesh_shape}, {BATCH_ENV}={mode}"] = {"error": error_text(exc)}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def part_e(settings: Settings, world: int | None = None) -> dict[str, Any]:
    """Ranks on ``world`` devices (default: every GPU, at most 8). Skipped with fewer than 2 GPUs;
    in the dry run, after the same harness ran on 2 gloo CPU ranks."""
    gpus = torch.cuda.device_count() if settings.cuda else 0
    if world is not None:
        return run(settings, world)
    if settings.dry_run:
        raise Skipped("NCCL ranks need 2+ CUDA GPUs; the harness ran on 2 gloo CPU ranks", run(settings, 2))
    if gpus < 2:
        raise Skipped(f"needs 2+ CUDA GPUs for NCCL ranks; {gpus} visible")
    return run(settings, min(gpus, 8))


def run(settings: Settings, world: int) -> dict[str, Any]:
    from muon_dtensor.testing import run_ranks

    timeout = max(60.0, settings.left_s())
    per_rank = run_ranks(rank_check, world, settings.layers, settings.dims, meshes(world), timeout=timeout)
    runs = {k: {key: v for key, v in row.items() if key != "sync_check"} for k, row in per_rank[0].items()}
    syncs = {k: [r[k].get("sync_check") for r in per_rank] for k in per_rank[0]}
    return {"world": world, "steps": STEPS, "runs": runs, "sync_check_per_rank": syncs}
