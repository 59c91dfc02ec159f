"""FSDP2 and HSDP models built with fully_shard: exact steps, training, and a DCP resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, model_grads, step_together


@pytest.mark.parametrize(("world_size", "mesh_shape"), [(1, (1,)), (2, (2,)), (4, (4,)), (4, (2, 2))])
def test_fully_shard_step_equals_single_process(world_size: int, mesh_shape: tuple) -> None:
    for rank, bad in enumerate(run_ranks(fully_shard_exactness, world_size, mesh_shape)):
        assert bad == [], f"rank {rank}: differs from one process at {bad}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_training_tracks_single_process(world_size: int) -> None:
    """Real backward passes: FSDP averages gradients over ranks in another order than one process
    sums them, so this is a float-tolerance check (exactness given equal gradients is tested above)."""
    result = run_ranks(train_both, world_size, (world_size,))[0]
    sharded, single = result["sharded"], result["single"]
    assert single["losses"][-1] < single["losses"][0]
    torch.testing.assert_close(sharded["losses"], single["losses"], rtol=2e-3, atol=2e-3)
    for name, p in single["params"].items():
        # lr 0.02 times a few bfloat16 roundings of the update
        assert (sharded["params"][name] - p).abs().max() <= 2e-3, name


@pytest.mark.parametrize(("world_size", "mesh_shape"), [(2, (2,)), (4, (2, 2))])
def test_dcp_resume_on_same_layout_is_bitwise(world_size: int, mesh_shape: tuple, tmp_path: Path) -> None:
    for rank, bad in enumerate(run_ranks(resume_exactness, world_size, mesh_shape, str(tmp_path / "ckpt"))):
        assert bad == [], f"rank {rank}: {bad}"


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def mismatched(model: nn.Module, opt: Muon, ref: nn.Module, ref_opt: Muon) -> list[str]:
    """Names of parameters and state entries whose full tensors differ from ``ref``'s in any bit."""
    ref_params = dict(ref.named_parameters())
    bad = []
    for name, p in model.named_parameters():
        q = ref_params[name]
        if not torch.equal(full(p.detach()), full(q.detach())):
            bad.append(name)
        for key, value in opt.state[p].items():
            if not torch.equal(full(value), full(ref_opt.state[q][key])):
                bad.append(f"{name}:{key}")
    return bad


def fully_shard_exactness(mesh_shape: tuple[int, ...], steps: int = 3) -> list[str]:
    """fully_shard (FSDP or HSDP) parameters stepped with the same full gradients as one process."""
    model, ref = build(mesh_shape), build(None)
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    runs = [(list(model.parameters()), opt), (list(ref.parameters()), ref_opt)]
    step_together(runs, model_grads(ref, 100), range(steps))
    return mismatched(model, opt, ref, ref_opt)


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
    return {"losses": losses, "params": {n: full(p.detach()) for n, p in model.named_parameters()}}


def train_both(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    return {"sharded": train(mesh_shape), "single": train(None)}


def _save_and_load(model: nn.Module, opt: Muon, into: nn.Module, into_opt: Muon, path: str) -> None:
    """DCP round trip through ``path``: ``model`` and ``opt`` saved, loaded into ``into``/``into_opt``."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    model_sd, optim_sd = get_state_dict(into, into_opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(into, into_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def resume_exactness(mesh_shape: tuple[int, ...], path: str, total: int = 4, split: int = 2) -> list[str]:
    """Train ``split`` steps, save with DCP, load into a fresh model and optimizer, train to ``total``:
    everything equals the uninterrupted run bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    straight, first, resumed = build(mesh_shape), build(mesh_shape), build(mesh_shape, seed=1)
    straight_opt, first_opt, resumed_opt = (
        Muon(split_params(m), lr=0.02) for m in (straight, first, resumed)
    )
    for step in range(total):
        _train_step(straight, straight_opt, _batch(step, rank, world, 4))
    for step in range(split):
        _train_step(first, first_opt, _batch(step, rank, world, 4))
    _save_and_load(first, first_opt, resumed, resumed_opt, path)
    bad = [f"after load: {m}" for m in mismatched(resumed, resumed_opt, first, first_opt)]
    for step in range(split, total):
        _train_step(resumed, resumed_opt, _batch(step, rank, world, 4))
    return bad + mismatched(resumed, resumed_opt, straight, straight_opt)
