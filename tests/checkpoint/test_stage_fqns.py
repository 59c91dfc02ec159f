"""Ranks that hold the same FQN in a save must be replicas of one tensor (issue 41 item 2).

Two pipeline stages built with local names (each stage's ``blocks.0``), plain or ``fully_shard``-ed
on a mesh of their own, once saved without error: DCP keeps one tensor per key, so stage 1 loaded
stage 0's weights and momentum (with other shapes, only the load refused). The save now refuses on
every rank, naming the FQN and the ranks, before anything is written. What must keep saving: a plain
parameter replicated over data-parallel ranks, FSDP shards of one parameter, FSDP with per-rank
buffers (pipeline stages with global FQNs: tests/test_pipeline_checkpoint*.py).

Issue 49 item 3: two stages with equal weights and different momentum (a warmup's first step at lr
0) saved silently, since a plain parameter was fingerprinted by its values alone, and a load mixed
the momenta. Its optimizer entries now join the fingerprint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from tests.harness.ranks import run_ranks


class Stage(nn.Module):
    """One pipeline stage, named locally: every stage's first block is ``blocks.0``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False))
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


_SAME_WEIGHTS = ("replicas", "fsdp", "ddp replicas", "equal weights")


def _stage(case: str) -> nn.Module:
    rank = dist.get_rank()
    torch.manual_seed(0 if case in _SAME_WEIGHTS else rank)  # stages hold their own weights
    model = Stage(8 + 4 * rank if case == "other shapes" else 8)
    if case == "per-stage meshes":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"])
    elif case == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        cast(torch.Tensor, model.seen).fill_(float(rank))  # buffers stay per rank under FSDP: not a clash
    return model


def save_stages(folder: str, case: str, asynchronous: bool) -> tuple[str, str, list[str]]:
    """Rank function: (error type, message, files under the root afterwards)."""
    model, rank = _stage(case), dist.get_rank()
    ddp = dist.group.WORLD if case == "ddp replicas" else None
    # "equal weights": a first step at lr 0 (a warmup's) on each stage's own data: the weights stay
    # equal, the momenta differ
    opt = Muon(model.parameters(), lr=0.0 if case == "equal weights" else 0.02, process_group=ddp)
    data = torch.ones(2, 8 + 4 * rank if case == "other shapes" else 8)
    model(data * (1 + rank) if case == "equal weights" else data).sum().backward()
    opt.step()
    root = Path(folder) / case.replace(" ", "_")
    try:
        if asynchronous:
            ckpt.async_save_checkpoint(root, 1, model, opt).wait()
        else:
            ckpt.save_checkpoint(root, 1, model, opt)
        kind, message = "no error", ""
    except ValueError as e:
        kind, message = type(e).__name__, str(e)
    dist.barrier()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    return kind, message, files


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("case", ["plain stages", "per-stage meshes", "other shapes", "equal weights"])
def test_stages_with_local_names_are_refused_on_every_rank(
    tmp_path: Path, case: str, asynchronous: bool
) -> None:
    results = run_ranks(save_stages, 2, str(tmp_path), case, asynchronous, timeout=120)
    assert len({(kind, message) for kind, message, _ in results}) == 1, results
    kind, message, files = results[0]
    assert kind == "ValueError", results
    assert "'blocks.0.weight' is held by ranks that are not replicas of one mesh" in message, message
    assert "rank(s) [0]" in message and "rank(s) [1]" in message, message
    assert all(not files for *_, files in results), results  # nothing written
    if case == "equal weights":  # told apart by the momentum alone
        assert "momentum_buffer" in message, message


@pytest.mark.parametrize("case", ["replicas", "fsdp", "ddp replicas"])
def test_replicas_and_shards_of_one_parameter_still_save(tmp_path: Path, case: str) -> None:
    results: list[Any] = run_ranks(save_stages, 2, str(tmp_path), case, False, timeout=120)
    assert all(kind == "no error" for kind, _, _ in results), results
    assert any(f.endswith("manifest.json") for f in results[0][2]), results
