"""Load arguments that differ between ranks raise on every rank, naming the argument, before
anything is loaded.

Regression: with ``optimizer_state='load'`` on one rank and ``'fresh'`` on the other, or the optimizer
passed on one rank only, both ranks returned success with half the momentum loaded; with the
safetensors file or a name missing on one rank, ``load_safetensors`` raised there only and the other
rank returned with its shards loaded. All cases run in one pooled 2-rank run; each rank reports
(error type, message, whether its model and optimizer were left untouched).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import export_safetensors, load_checkpoint, load_safetensors, save_checkpoint
from tests.harness.ranks import run_ranks
from tests.helpers.models import dt


def _model(seed: int) -> tuple[nn.Module, Muon]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh)
    opt = Muon(split_params(model, adamw=["2.*"]), lr=0.02)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return model, opt


def _snapshot(model: nn.Module, opt: Muon) -> list[torch.Tensor]:
    tensors = [dt(p).full_tensor() for p in model.parameters()]
    return tensors + [
        v.full_tensor() for s in opt.state.values() for v in s.values() if hasattr(v, "full_tensor")
    ]


def _case(root: Path, name: str, model: nn.Module, opt: Muon) -> None:
    rank = dist.get_rank()
    if name == "optimizer_state_differs":
        load_checkpoint(root / "ckpt", model, opt, optimizer_state="load" if rank == 0 else "fresh")
    elif name == "optimizer_on_one_rank":
        load_checkpoint(root / "ckpt", model, opt if rank == 0 else None)
    elif name == "bad_optimizer_state_on_one_rank":
        load_checkpoint(root / "ckpt", model, opt, optimizer_state="load" if rank == 0 else "lod")
    elif name == "step_differs":
        load_checkpoint(root / "ckpt", model, opt, step=1 if rank == 0 else None)
    elif name == "file_missing_on_one_rank":
        load_safetensors(model, root / ("hf" if rank == 0 else "empty"))
    elif name == "name_missing_on_one_rank":
        load_safetensors(model, root / ("hf" if rank == 0 else "hf_partial"), strict=False)
    elif name == "strict_differs":
        load_safetensors(model, root / "hf", strict=rank == 0)


CASES = {
    "optimizer_state_differs": (
        "ValueError",
        r"optimizer_state: 'load' on rank 0, 'fresh' on rank 1",
    ),
    "optimizer_on_one_rank": ("ValueError", r"optimizer: 'Muon' on rank 0, None on rank 1"),
    # a value that differs is named as a disagreement first (a local check failure may follow from it)
    "bad_optimizer_state_on_one_rank": ("ValueError", r"optimizer_state: 'load' on rank 0, 'lod' on rank 1"),
    "step_differs": ("ValueError", r"step: 1 on rank 0, None on rank 1"),
    "file_missing_on_one_rank": ("CheckpointError", r"empty: no safetensors file there"),
    "name_missing_on_one_rank": ("ValueError", r"names loaded: rank 1 lacks 2.bias"),
    "strict_differs": ("ValueError", r"strict: True on rank 0, False on rank 1"),
}


def run_cases(root: str) -> dict[str, Any]:
    base = Path(root)
    model, opt = _model(0)
    save_checkpoint(base / "ckpt", 1, model, opt)
    if dist.get_rank() == 0:
        export_safetensors(base / "ckpt" / "step_00000001", base / "hf")
        (base / "empty").mkdir()
    dist.barrier()
    if dist.get_rank() == 0:
        tensors = load_file(str(base / "hf" / "model.safetensors"))
        (base / "hf_partial").mkdir()
        partial = {k: v for k, v in tensors.items() if k != "2.bias"}
        save_file(partial, str(base / "hf_partial" / "model.safetensors"))
    dist.barrier()
    out: dict[str, tuple[str | None, str, bool]] = {}
    for name in CASES:
        model, opt = _model(1)  # other values than the saved ones
        before = _snapshot(model, opt)
        try:
            _case(base, name, model, opt)
            out[name] = (None, "", True)
        except Exception as e:  # noqa: BLE001 - each rank reports what it raised
            after = _snapshot(model, opt)
            same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
            out[name] = (type(e).__name__, str(e), same)
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(run_cases, 2, str(tmp_path_factory.mktemp("agree")), timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_differing_load_arguments_raise_on_every_rank(outcomes: list[dict[str, Any]], case: str) -> None:
    kind, pattern = CASES[case]
    for rank, per_rank in enumerate(outcomes):
        error, message, untouched = per_rank[case]
        assert error == kind, f"rank {rank}: {error}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message}"
        assert untouched, f"rank {rank}: the model or optimizer changed"
