"""Checkpoints through DCP: resume on any layout, bytes per rank, publication, faults, bad input."""

from __future__ import annotations

import pytest
import torch

import muon_dtensor.checkpoint as ckpt
from muon_dtensor.demo.launch import RankError
from tests.distributed import run_ranks
from tests.workers_ckpt import (
    bytes_per_rank,
    crash_during_save,
    load_expecting_error,
    resume_and_finish,
    save_after,
    uninterrupted,
)

TOTAL, SPLIT = 5, 2


def _ranks(layout: str) -> int:
    return {"fsdp1": 1, "fsdp2": 2, "fsdp4": 4, "hsdp": 4}[layout]


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [
        ("fsdp2", "fsdp2"),
        ("fsdp4", "fsdp2"),
        ("fsdp2", "fsdp4"),
        ("fsdp2", "fsdp1"),
        ("fsdp1", "fsdp2"),
        ("fsdp4", "hsdp"),
    ],
)
def test_resume_on_any_layout(saved_on: str, resumed_on: str, tmp_path) -> None:
    """Gradients here are the same full tensors on every layout, so every run is bitwise the
    one-process run: momentum after load equals the saved momentum bitwise, AdamW step counters
    survive, and the resumed run ends bitwise where the uninterrupted one ends."""
    root = str(tmp_path)
    saved = run_ranks(save_after, _ranks(saved_on), saved_on.rstrip("124") or "fsdp", root, SPLIT)[0]
    layout = "hsdp" if resumed_on == "hsdp" else "fsdp"
    resumed = run_ranks(resume_and_finish, _ranks(resumed_on), layout, root, TOTAL)
    reference = uninterrupted(TOTAL)
    for rank, r in enumerate(resumed):
        assert r["extra"] == {"step": SPLIT, "data_position": SPLIT * 8}
        for key, value in saved.items():
            assert torch.equal(r["loaded"][key], value), f"rank {rank}: {key} changed by save/load"
        assert any(k.startswith("step:") and int(v) == SPLIT for k, v in r["loaded"].items())
        for key, value in reference.items():
            assert torch.equal(r["final"][key], value), f"rank {rank}: {key} differs from uninterrupted"


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_writes_only_its_shards(world_size: int, tmp_path) -> None:
    results = run_ranks(bytes_per_rank, world_size, str(tmp_path / "c"))
    total = sum(r["file_bytes"] for r in results)
    for rank, r in enumerate(results):
        assert abs(r["file_bytes"] - total / world_size) <= 0.10 * total / world_size, (rank, results)
        assert r["file_bytes"] >= r["local_state_bytes"]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path) -> None:
    root = str(tmp_path)
    with pytest.raises(RankError):
        run_ranks(crash_during_save, 2, root, timeout=40)
    assert ckpt.complete_steps(root) == [2]
    assert (tmp_path / ".tmp_step_00000004").exists()  # the half-written save, never picked
    resumed = run_ranks(resume_and_finish, 2, "fsdp", root, 3)
    assert resumed[0]["extra"]["step"] == 2


def _saved(tmp_path, world_size: int = 2) -> str:
    root = str(tmp_path / "ck")
    run_ranks(save_after, world_size, "fsdp", root, 1)
    return root


def test_corrupted_and_truncated_files_are_named(tmp_path) -> None:
    root = _saved(tmp_path)
    shard = tmp_path / "ck" / "step_00000001" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(data))
    for kind, message, untouched in run_ranks(load_expecting_error, 2, root, "same"):
        assert kind == "CheckpointError" and "__1_0.distcp: checksum mismatch" in message and untouched
    shard.write_bytes(bytes(data[:100]))
    for kind, message, _ in run_ranks(load_expecting_error, 2, root, "same"):
        assert kind == "CheckpointError" and "__1_0.distcp: 100 bytes" in message


@pytest.mark.parametrize(
    ("kind", "pattern"),
    [
        (
            "other_model",
            r"Missing from the checkpoint: model\.0\.bias.*Unexpected in the checkpoint: .*model\.embed\.weight",
        ),
        ("shape", r"shape mismatch: model\.layers\.3\.bias: saved \(24,\), expected \(25,\)"),
        ("groups", r"Missing from the checkpoint: .*exp_avg"),
    ],
)
def test_incompatible_checkpoint_loads_nothing(kind: str, pattern: str, tmp_path) -> None:
    root = _saved(tmp_path)
    for rank, (error, message, untouched) in enumerate(run_ranks(load_expecting_error, 2, root, kind)):
        assert error == "CheckpointError", (rank, error, message)
        assert __import__("re").search(pattern, message), message
        assert untouched, f"rank {rank}: the model changed although the load was refused"


def test_keep_last_and_never_overwrite(tmp_path) -> None:
    from muon_dtensor import Muon, split_params
    from tests.workers_fsdp import build

    model = build(None)
    opt = Muon(split_params(model))
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, opt, keep_last=2)
    assert ckpt.complete_steps(tmp_path) == [3, 4] and ckpt.latest_step(tmp_path) == 4
    with pytest.raises(FileExistsError, match="never overwritten"):
        ckpt.save_checkpoint(tmp_path, 4, model, opt)
    assert ckpt.load_checkpoint(tmp_path / "empty", model, opt) is None


def test_async_save_while_training(tmp_path) -> None:
    from tests.workers_ckpt import async_save_while_training

    assert run_ranks(async_save_while_training, 2, str(tmp_path)) == [True, True]


def test_checkpoint_at_step_zero(tmp_path) -> None:
    """State exists before the first step, so a step-0 checkpoint is complete and loads."""
    from muon_dtensor import Muon, split_params
    from tests.workers_fsdp import build

    model = build(None)
    opt = Muon(split_params(model))
    ckpt.save_checkpoint(tmp_path, 0, model, opt)
    fresh = build(None, seed=3)
    fresh_opt = Muon(split_params(fresh))
    assert ckpt.load_checkpoint(tmp_path, fresh, fresh_opt) == {"step": 0}
    for (_, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q)
        assert set(opt.state[p]) == set(fresh_opt.state[q])
