"""Checkpoints move between torch.optim.Muon (+ AdamW) and muon_dtensor.Muon; state dtype policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _torch_pair(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    groups = split_params(model)
    muon = torch.optim.Muon([p for _, p in groups[0]["params"]], lr=0.02)
    adamw = torch.optim.AdamW([p for _, p in groups[1]["params"]], lr=3e-3)
    return muon, adamw


def _train(model: nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 3) -> None:
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for o in optimizers:
            o.zero_grad()
        model(x).square().mean().backward()
        for o in optimizers:
            o.step()


def _save(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizers)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)


def _load(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    planner = DefaultLoadPlanner(allow_partial_load=True)
    dcp.load(state, checkpoint_id=str(path), planner=planner, no_dist=True)
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _states(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    out = {}
    for o in optimizers:
        for name, p in model.named_parameters():
            for key, value in o.state.get(p, {}).items():
                out[f"{name}:{key}"] = value
    return out


def test_torch_checkpoint_loads_into_muon_dtensor_and_back(tmp_path: Path) -> None:
    model = _model()
    theirs = list(_torch_pair(model))
    _train(model, theirs)
    _save(tmp_path / "torch", model, theirs)

    ours_model = _model(seed=1)
    ours = Muon(split_params(ours_model), lr=0.02)
    _load(tmp_path / "torch", ours_model, [ours])
    expected = _states(model, theirs)
    got = _states(ours_model, [ours])
    assert expected.keys() == got.keys() and len(expected) == 2 + 3 * 4
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    _save(tmp_path / "ours", ours_model, [ours])
    back_model = _model(seed=2)
    back = list(_torch_pair(back_model))
    _load(tmp_path / "ours", back_model, back)
    again = _states(back_model, back)
    assert again.keys() == expected.keys() and all(torch.equal(again[k], expected[k]) for k in expected)


def test_momentum_dtype_is_the_parameter_dtype_before_and_after_load(tmp_path: Path) -> None:
    """Policy (as torch.optim.Muon): momentum is kept in the parameter's dtype, so DCP's cast to the
    parameter dtype on load changes nothing; a bf16 parameter has bf16 momentum."""
    model = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    opt = Muon(model.named_parameters())
    model.weight.grad = torch.randn(8, 8, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[model.weight]["momentum_buffer"].dtype == torch.bfloat16
    saved = opt.state[model.weight]["momentum_buffer"].clone()
    _save(tmp_path / "c", model, [opt])
    fresh = nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    fresh_opt = Muon(fresh.named_parameters())
    _load(tmp_path / "c", fresh, [fresh_opt])
    loaded = fresh_opt.state[fresh.weight]["momentum_buffer"]
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, saved)


def test_dcp_state_init_step_is_collective_safe() -> None:
    for r in run_ranks(state_init_through_dcp, 2, timeout=60):
        assert r["unchanged"] and r["lr_restored"]
        assert r["params_with_state"] == r["params"]
        assert r["keys"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]


# Rank function (run by tests.harness.ranks in every rank of the pool).


def state_init_through_dcp() -> dict[str, Any]:
    """DCP's get_state_dict steps an optimizer without state (zero gradients, lr 0): that step must
    take the same collective path on every rank, change no parameter and create every state key."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)
    opt.state.clear()
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    _, optim_sd = get_state_dict(model, opt)
    state = cast(dict[Any, dict[str, Any]], optim_sd["state"])
    after = {n: full(p.detach()) for n, p in model.named_parameters()}
    return {
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
        "keys": sorted({k for s in state.values() for k in s}),
        "params_with_state": len(state),
        "params": len(before),
        "lr_restored": opt.param_groups[0]["lr"] == 0.02,
    }
