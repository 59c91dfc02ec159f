"""NorMuon's state: the second moment follows parameters swapped for DTensors, saves and
loads through DCP on another world size bit for bit, and bad options or layouts are refused with an
error that names the parameter. The maths and its exactness under sharding: tests/numerics/test_normuon.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.base.compat import StridedShard as _StridedShard
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, model_grads, step_together

LR = 0.02
KEY = "second_momentum_buffer"


def swapped_for_dtensors(steps: int = 3) -> dict[str, Any]:
    """Rank function: the optimizer built on plain parameters, stepped once, then its parameters
    swapped in ``param_groups`` for Shard(1) DTensors (as accelerate swaps in fully_shard's): the
    second moment follows, laid out like its parameter, and the run stays the one-process run."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(shape, generator=gen) for shape in ((10, 7), (5, 12))]
    params = [nn.Parameter(w.clone()) for w in weights]
    ref = [nn.Parameter(w.clone()) for w in weights]
    opt = Muon([{"params": params, "normuon": True}], lr=LR)
    ref_opt = Muon([{"params": ref, "normuon": True}], lr=LR)
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(steps)]
    for step in range(steps):
        if step == 1:
            swapped = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(1)])) for p in params]
            opt.param_groups[0]["params"] = params = swapped
        for p, q, g in zip(params, ref, grads[step]):
            p.grad, q.grad = (distribute_tensor(g, mesh, [Shard(1)]) if step else g.clone()), g.clone()
        opt.step()
        ref_opt.step()
    bad: list[int | str] = [
        i for i, (p, q) in enumerate(zip(params, ref)) if not torch.equal(full(p.detach()), q.detach())
    ]
    seconds = [opt.state[p][KEY] for p in params]
    bad += [
        f"{i} {KEY}"
        for i, (v, q) in enumerate(zip(seconds, ref))
        if not torch.equal(full(v), ref_opt.state[q][KEY])
    ]
    return {"bad": bad, "placements": [tuple(v.placements) for v in seconds], "states": len(opt.state)}


def test_swapped_parameters_take_their_second_moment_along() -> None:
    for rank, result in enumerate(run_ranks(swapped_for_dtensors, 2, timeout=120)):
        assert result["bad"] == [], f"rank {rank}: {result['bad']}"
        assert result["placements"] == [(Shard(1),)] * 2 and result["states"] == 2, result


# ---------------------------------------------------------------------------------------- checkpoints

TOTAL, SPLIT = 5, 2


def _normuon_net(mesh_shape: tuple[int, ...] | None, seed: int = 0) -> tuple[nn.Module, Muon]:
    model = build(mesh_shape, seed)
    groups = split_params(model)
    groups[0].update(normuon=True, beta2=0.9)
    return model, Muon(groups, lr=LR)


def _snapshot(model: nn.Module, opt: Muon) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"{key}:{n}": full(value).clone() for key, value in opt.state[p].items()})
    return out


def save_normuon(root: str) -> dict[str, torch.Tensor]:
    model, opt = _normuon_net((dist.get_world_size(),))
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), range(SPLIT))
    ckpt.save_checkpoint(root, SPLIT, model, opt)
    return _snapshot(model, opt)


def resume_normuon(root: str) -> dict[str, dict[str, torch.Tensor]]:
    world = dist.get_world_size()
    model, opt = _normuon_net((world,) if world > 1 else None, seed=7)  # the load must replace these
    info = ckpt.load_checkpoint(root, model, opt)
    assert info is not None and info["step"] == SPLIT
    loaded = _snapshot(model, opt)
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), range(SPLIT, TOTAL))
    return {"loaded": loaded, "final": _snapshot(model, opt)}


@pytest.mark.parametrize("resume_world", [4, 1])
def test_dcp_resume_on_another_world_size(resume_world: int, tmp_path: Path) -> None:
    """Saved at 2 ranks, loaded at 4 or in one process: the second moments (and everything else)
    come back bit for bit, and the resumed run ends where an unbroken one-process run ends."""
    root = str(tmp_path / "ckpt")
    saved = run_ranks(save_normuon, 2, root, timeout=180)[0]
    assert sum(key.startswith(KEY) for key in saved) == 5  # every hidden matrix has one
    resumed = run_ranks(resume_normuon, resume_world, root, timeout=180)
    model, opt = _normuon_net(None)
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), range(TOTAL))
    unbroken = _snapshot(model, opt)
    for rank, result in enumerate(resumed):
        for key, value in saved.items():
            assert torch.equal(result["loaded"][key], value), f"rank {rank}: {key} changed by save/load"
        for key, value in unbroken.items():
            assert torch.equal(result["final"][key], value), f"rank {rank}: {key} differs from unbroken"


# ----------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"normuon": True, "beta2": 1.0}, "beta2 (NorMuon's second-moment decay) should be in [0, 1)"),
        ({"normuon": True, "beta2": -0.1}, "but is: -0.1; the official default is 0.95"),
        ({"normuon": "yes"}, "'normuon' should be True or False but is: 'yes'"),
        ({"normuon": True, "algorithm": "adamw"}, "is an option of Muon groups"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], error: str) -> None:
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError) as info:
        Muon([{"params": [p], **options}])
    assert error in str(info.value)


def test_flatten_is_refused_naming_the_parameter() -> None:
    conv = nn.Conv2d(3, 4, 3)
    with pytest.raises(
        ValueError, match="parameter 'conv.weight' of shape \\(4, 3, 3, 3\\) would be flattened"
    ):
        Muon([{"params": [("conv.weight", conv.weight)], "normuon": True, "flatten": True}])


def mislaid_second_moment() -> str:
    """Rank function: a second moment replaced by a plain full column on a Shard(1) parameter."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p = nn.Parameter(distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]))
    opt = Muon([{"params": [("w", p)], "normuon": True}])
    opt.state[p][KEY] = distribute_tensor(torch.zeros(6, 1), mesh, [Replicate()])
    p.grad = distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)])
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_mislaid_second_moment_is_refused_on_every_rank() -> None:
    rank0, rank1 = run_ranks(mislaid_second_moment, 2, timeout=120)
    # every rank raises the failing rank's own error (checks/together.py), which names the parameter
    assert rank0 == rank1
    assert "parameter 'w': its 'second_momentum_buffer' has local shape (6, 1)" in rank1


def strided_last_dim() -> str:
    """Rank function: a parameter whose columns are interleaved (_StridedShard on the last dim)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placement = _StridedShard(1, split_factor=2)
    p = DTensor.from_local(
        torch.zeros(4, 4), mesh, [placement], shape=torch.Size((4, 8)), stride=(8, 1), run_check=False
    )
    try:
        Muon([{"params": [("w", nn.Parameter(p))], "normuon": True}])
    except ValueError as e:
        return str(e)
    return "no error"


def test_interleaved_columns_are_refused() -> None:
    for error in run_ranks(strided_last_dim, 2, timeout=120):
        assert "parameter 'w' has placements" in error and "NorMuon needs its last dimension" in error


def test_demo_flag_reaches_only_the_muon_dtensor_runs() -> None:
    """``python -m muon_dtensor demo --normuon``: muon_dtensor's runs use NorMuon, round-robin's not
    (the full demo with the flag resumes bitwise, like the plain one; not rerun here for time)."""
    from muon_dtensor.demo import run

    args = run._parser().parse_args(["--normuon"])
    assert run._base(args, "muon_dtensor", "bfloat16").normuon
    assert not run._base(args, "round_robin", "bfloat16").normuon
    assert not run._base(run._parser().parse_args([]), "muon_dtensor", "bfloat16").normuon
