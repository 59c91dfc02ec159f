"""Checkpoints through DCP: resume on any layout, bytes per rank, publication, faults, bad input."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.testing import run_ranks as run_fresh
from tests.harness.ranks import RankError, run_ranks
from tests.helpers.models import Net, build, fsdp, full, model_grads, step_together

TOTAL, SPLIT = 5, 2
RANKS = {"fsdp1": 1, "fsdp2": 2, "fsdp4": 4, "hsdp": 4}
Saved = Callable[[str], tuple[str, dict[str, torch.Tensor]]]  # layout -> (root, state saved there)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """layout -> (root, state at SPLIT) of an FSDP checkpoint saved at step SPLIT on that many ranks.
    Each layout's checkpoint is saved once and shared by the tests that only read it."""
    cache: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def get(layout: str) -> tuple[str, dict[str, torch.Tensor]]:
        if layout not in cache:
            root = str(tmp_path_factory.mktemp(f"saved_{layout}"))
            cache[layout] = (root, run_ranks(save_after, RANKS[layout], "fsdp", root, SPLIT)[0])
        return cache[layout]

    return get


LAYOUT_PAIRS = [
    ("fsdp2", "fsdp2"),
    ("fsdp4", "fsdp2"),
    ("fsdp2", "fsdp4"),
    ("fsdp2", "fsdp1"),
    ("fsdp1", "fsdp2"),
    ("fsdp4", "hsdp"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("saved_on", "resumed_on"), LAYOUT_PAIRS)
def test_resume_on_any_layout(saved: Saved, saved_on: str, resumed_on: str) -> None:
    """Gradients here are the same full tensors on every layout, so every run is bitwise the
    one-process run: momentum after load equals the saved momentum bitwise, AdamW step counters
    survive, and the resumed run ends bitwise where the uninterrupted one ends."""
    _resumes_bitwise(saved, saved_on, resumed_on)


# The fast tier's share: one checkpoint (2 ranks) resumed on more ranks and on fewer; the three
# other saves (1 and 4 ranks) and the same-size and HSDP resumes are the slow test's.
@pytest.mark.sample_of("test_resume_on_any_layout")
@pytest.mark.parametrize(("saved_on", "resumed_on"), [("fsdp2", "fsdp4"), ("fsdp2", "fsdp1")])
def test_resume_on_more_and_on_fewer_ranks(saved: Saved, saved_on: str, resumed_on: str) -> None:
    _resumes_bitwise(saved, saved_on, resumed_on)


def _resumes_bitwise(saved: Saved, saved_on: str, resumed_on: str) -> None:
    root, state = saved(saved_on)
    layout = "hsdp" if resumed_on == "hsdp" else "fsdp"
    resumed = run_ranks(resume_and_finish, RANKS[resumed_on], layout, root, TOTAL)
    reference = uninterrupted(TOTAL)
    for rank, r in enumerate(resumed):
        assert r["extra"] == {"step": SPLIT, "data_position": SPLIT * 8}
        for key, value in state.items():
            assert torch.equal(r["loaded"][key], value), f"rank {rank}: {key} changed by save/load"
        assert any(k.startswith("step:") and int(v) == SPLIT for k, v in r["loaded"].items())
        for key, value in reference.items():
            assert torch.equal(r["final"][key], value), f"rank {rank}: {key} differs from uninterrupted"


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_writes_only_its_shards(world_size: int, tmp_path: Path) -> None:
    results = run_ranks(bytes_per_rank, world_size, str(tmp_path / "c"))
    total = sum(r["file_bytes"] for r in results)
    for rank, r in enumerate(results):
        assert abs(r["file_bytes"] - total / world_size) <= 0.10 * total / world_size, (rank, results)
        assert r["file_bytes"] >= r["local_state_bytes"]


@pytest.mark.slow
def test_crash_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    """Fresh processes: a rank leaves through os._exit in the middle of a save."""
    root = str(tmp_path)
    with pytest.raises(RankError):
        run_fresh(crash_during_save, 2, root, timeout=40)
    assert ckpt.complete_steps(root) == [2]
    assert not list(tmp_path.glob(".tmp_step_0000000*"))  # rank 0 raised and removed the failed save
    resumed = run_ranks(resume_and_finish, 2, "fsdp", root, 3)
    assert resumed[0]["extra"]["step"] == 2


def test_corrupted_and_truncated_files_are_named(saved: Saved, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved("fsdp2")[0], root)  # a private copy to damage
    shard = root / f"step_{SPLIT:08d}" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(data))
    for kind, message, untouched in run_ranks(load_expecting_error, 2, str(root), "same"):
        assert kind == "CheckpointError" and "__1_0.distcp: checksum mismatch" in message and untouched
    shard.write_bytes(bytes(data[:100]))
    for kind, message, _ in run_ranks(load_expecting_error, 2, str(root), "same"):
        assert kind == "CheckpointError" and "__1_0.distcp: 100 bytes" in message


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        (
            "other_model",
            r"Missing from the checkpoint: 0\.bias.*Unexpected in the checkpoint: .*embed\.weight",
        ),
        ("shape", r"shape mismatch: layers\.3\.bias: saved \(24,\), expected \(25,\)"),
        ("groups", r"Missing from the checkpoint: .*exp_avg"),
    ],
)
def test_incompatible_checkpoint_loads_nothing(saved: Saved, kind: str, pattern: str) -> None:
    root = saved("fsdp2")[0]
    for rank, (error, message, untouched) in enumerate(run_ranks(load_expecting_error, 2, root, kind)):
        assert error == "CheckpointError", (rank, error, message)
        assert re.search(pattern, message), message
        assert untouched, f"rank {rank}: the model changed although the load was refused"


def test_keep_last_and_never_overwrite(tmp_path: Path) -> None:
    model = build(None)
    opt = Muon(split_params(model))
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, opt, keep_last=2)
    assert ckpt.complete_steps(tmp_path) == [3, 4] and ckpt.latest_step(tmp_path) == 4
    with pytest.raises(FileExistsError, match="never overwritten"):
        ckpt.save_checkpoint(tmp_path, 4, model, opt)
    assert ckpt.load_checkpoint(tmp_path / "empty", model, opt) is None


def test_async_save_while_training(tmp_path: Path) -> None:
    assert run_ranks(async_save_while_training, 2, str(tmp_path)) == [True, True]


def test_checkpoint_at_step_zero(tmp_path: Path) -> None:
    """State exists before the first step, so a step-0 checkpoint is complete and loads."""
    model = build(None)
    opt = Muon(split_params(model))
    ckpt.save_checkpoint(tmp_path, 0, model, opt)
    fresh = build(None, seed=3)
    fresh_opt = Muon(split_params(fresh))
    assert ckpt.load_checkpoint(tmp_path, fresh, fresh_opt) == {"step": 0}
    for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q)
        assert set(opt.state[p]) == set(fresh_opt.state[q])


# Rank functions (run by tests.harness.ranks in every rank of the pool; crash_during_save in fresh ranks).


def _mesh_shape(layout: str) -> tuple[int, ...]:
    world = dist.get_world_size()
    return (2, world // 2) if layout == "hsdp" else (world,)


def _run(model: nn.Module, opt: Muon, steps: range) -> None:
    """Steps with synthetic full gradients that do not depend on the layout."""
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), steps)


def _snapshot(model: nn.Module, opt: Muon) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state[p].items():
            out[f"{key}:{n}"] = full(value).clone()
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
    assert extra is not None, f"no checkpoint in {root}"
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
    for i, layer in enumerate(cast(list[nn.Linear], list(model))):
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

        ckpt.save.file_record = die
    ckpt.save_checkpoint(root, 4, model, opt)


def _incompatible(kind: str) -> nn.Module:
    """A model that ``kind`` makes unlike the saved one ("same": the saved model itself)."""
    torch.manual_seed(3)
    if kind == "other_model":
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    if kind == "shape":
        model = Net()
        model.layers[3] = nn.Linear(24, 25)  # 25 rows where 24 were saved
        return fsdp(model, (dist.get_world_size(),))
    return build((dist.get_world_size(),))


def load_expecting_error(root: str, kind: str) -> tuple[str, str, bool]:
    """Load into a model that ``kind`` makes incompatible; report the error and whether the model
    was left untouched."""
    model = _incompatible(kind)
    groups = split_params(model)
    if kind == "groups":
        groups = [{"params": [(n, p) for g in groups for n, p in g["params"]], "algorithm": "adamw"}]
    opt = Muon(groups, lr=0.02)
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    try:
        ckpt.load_checkpoint(root, model, opt)
    except Exception as e:  # noqa: BLE001
        after = {n: full(p.detach()) for n, p in model.named_parameters()}
        untouched = all(torch.equal(before[n], after[n]) for n in before)
        return type(e).__name__, str(e), untouched
    return "none", "", True


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
