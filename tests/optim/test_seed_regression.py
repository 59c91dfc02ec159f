"""The bug this package exists for.

KellerJordan/Muon's distributed optimizer gives parameter i to rank i % world: that rank alone
updates it and alone keeps its momentum buffer, then broadcasts the parameter. Nothing ever syncs
the momentum. A user saves ``optimizer.state_dict()`` from rank 0, as with any other optimizer, and
the checkpoint holds 1 of every ``world`` momentum buffers; on resume the others restart from zero
and the run silently leaves the uninterrupted trajectory (users reported it on the KellerJordan/Muon
issue tracker: "Does Muon save the state["momentum_buffer"] correctly in a distributed setting?").
With muon_dtensor the momentum buffers are DTensors shaped like their parameters, DCP writes every
rank's shard, and the resumed run is the uninterrupted run, bit for bit.

The round-robin optimizer here is the demo's test double (muon_dtensor.demo.round_robin), one copy.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.optim import Optimizer

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from muon_dtensor.demo.round_robin import RoundRobinMuon
from tests.harness.ranks import run_ranks
from tests.helpers.models import full, random_grads, step_together

SHAPES = [(32, 16)] * 8
LR = 0.02


def test_round_robin_loses_momentum_and_muon_dtensor_keeps_it(tmp_path: Path) -> None:
    theirs = run_ranks(round_robin_resume, 4, str(tmp_path))[0]
    assert theirs["buffers_kept"] == theirs["buffers"] // 4  # 2 of 8: only rank 0's matrices
    assert theirs["gap"] > 1e-3  # the resumed run diverges from the uninterrupted one
    ours = run_ranks(muon_dtensor_resume, 4, str(tmp_path / "ours"))[0]
    assert ours["buffers_kept"] == ours["buffers"]
    assert ours["gap"] == 0.0


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _params(sharded: bool) -> list[nn.Parameter]:
    fulls = random_grads(SHAPES, 0)  # the initial values
    if not sharded:
        return [nn.Parameter(f) for f in fulls]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]


def _train(params: list[nn.Parameter], opt: Optimizer, steps: range) -> None:
    step_together([(params, opt)], lambda step: random_grads(SHAPES, step), steps)


def _gap(params: list[nn.Parameter], straight: list[nn.Parameter]) -> float:
    return max(float((full(a.detach()) - full(b.detach())).abs().max()) for a, b in zip(params, straight))


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
    return {"buffers_kept": kept, "buffers": len(SHAPES), "gap": _gap(resumed, straight)}


def muon_dtensor_resume(folder: str, total: int = 6, split: int = 3) -> dict[str, float]:
    straight = _params(True)
    _train(straight, Muon(straight, lr=LR, weight_decay=0.0), range(total))
    params = _params(True)
    opt = Muon(params, lr=LR, weight_decay=0.0)
    _train(params, opt, range(split))
    ckpt.save_checkpoint(folder, split, nn.ParameterList(params), opt)
    resumed = _params(True)
    ropt = Muon(resumed, lr=LR, weight_decay=0.0)
    ckpt.load_checkpoint(folder, nn.ParameterList(resumed), ropt)
    kept = sum(bool(full(ropt.state[p]["momentum_buffer"]).any()) for p in resumed)
    _train(resumed, ropt, range(split, total))
    return {"buffers_kept": kept, "buffers": len(SHAPES), "gap": _gap(resumed, straight)}
