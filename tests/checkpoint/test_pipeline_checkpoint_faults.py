"""What the checkpoint helpers promise holds for pipeline stages too (2 stages x 2 FSDP2 shards on 4
ranks, ``tests.helpers.stage_layouts``): sync and async saves with ``keep_last``, weights-only and fresh
loads, a damaged or missing shard of one stage named on every rank with nothing loaded, a full disk
on one stage's rank and a stage rank that dies mid-save raising on every rank with nothing
published."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import muon_dtensor.checkpoint as ckpt
import muon_dtensor.checkpoint.save as helpers
from muon_dtensor.testing import RankError
from muon_dtensor.testing import run_ranks as run_fresh
from tests.harness import background
from tests.helpers.pipeline import differences, snapshot
from tests.helpers.stage_layouts import build, train

TIMEOUT = 120.0


def test_stage_checkpoints_keep_their_promises(stage_promises: list[Any]) -> None:
    for rank, r in enumerate(stage_promises):
        assert r["kept"] == [2, 3], (rank, r["kept"])
        assert r["weights_only"] == [] and r["fresh"] == [] and r["zero_momentum"], rank
        for case in ("flipped", "missing"):
            kind, message, untouched = r[case]
            assert kind == "CheckpointError" and untouched, (rank, case, message)
        assert "__2_0.distcp: checksum mismatch" in r["flipped"][1], r["flipped"]
        assert "__3_0.distcp: missing" in r["missing"][1], r["missing"]
        kind, message, published = r["full_disk"]
        assert kind == "OSError" and "No space left on device" in message and published == [2, 3], r


@pytest.mark.slow
def test_a_stage_rank_that_dies_mid_save_publishes_nothing(tmp_path: Path) -> None:
    """Fresh processes: rank 3 (stage 1) leaves through os._exit after writing its shards."""
    with pytest.raises(RankError):
        run_fresh(die_mid_save, 4, str(tmp_path), timeout=90)
    assert ckpt.complete_steps(tmp_path) == [1]
    assert not list(tmp_path.glob(".tmp_step_*"))  # a surviving rank 0 removed the failed save


# Rank functions (run by tests.harness.ranks in every rank of the pool; die_mid_save in fresh ranks).


def _load_outcome(folder: Path) -> tuple[str, str, bool]:
    """Load ``folder`` into fresh stages: the error, and whether nothing changed."""
    model, opt = build("stages", seed=5)
    before = snapshot(model, opt)
    try:
        ckpt.load_checkpoint(folder, model, opt)
        kind, message = "ok", ""
    except Exception as e:  # noqa: BLE001 - the error is the result
        kind, message = type(e).__name__, str(e)
    return kind, message, differences(snapshot(model, opt), before) == []


def _damaged(root: Path, step: int, name: str, how: str) -> Path:
    """A copy of ``step``'s folder (made by rank 0) with one stage-1 shard file flipped or deleted."""
    copy = root / how
    if dist.get_rank() == 0:
        shutil.copytree(ckpt.step_dir(root, step), ckpt.step_dir(copy, step))
        shard = ckpt.step_dir(copy, step) / name
        if how == "missing":
            shard.unlink()
        else:
            data = bytearray(shard.read_bytes())
            data[-9] ^= 0x01
            shard.write_bytes(bytes(data))
    dist.barrier()
    return copy


def promises(root_name: str) -> dict[str, Any]:
    root = Path(root_name)
    model, opt = build("stages", seed=0)
    for step in (1, 2, 3):
        train(model, opt, range(step - 1, step))
        if step == 2:  # an async save of the stages, published by wait()
            ckpt.async_save_checkpoint(root, step, model, opt, keep_last=2).wait()
        else:
            ckpt.save_checkpoint(root, step, model, opt, keep_last=2)
    out: dict[str, Any] = {"kept": ckpt.complete_steps(root)}
    saved = snapshot(model, opt)
    weights = {k: v for k, v in saved.items() if ":" not in k}
    fresh, fresh_opt = build("stages", seed=5)
    ckpt.load_checkpoint(root, fresh)  # weights only: no optimizer
    out["weights_only"] = differences(
        {k: v for k, v in snapshot(fresh, fresh_opt).items() if ":" not in k}, weights
    )
    fresh, fresh_opt = build("stages", seed=5)
    train(fresh, fresh_opt, range(1))  # a trained optimizer, restarted by the load
    ckpt.load_checkpoint(root, fresh, fresh_opt, optimizer_state="fresh")
    after = snapshot(fresh, fresh_opt)
    out["fresh"] = differences({k: v for k, v in after.items() if ":" not in k}, weights)
    out["zero_momentum"] = all(not v.any() for k, v in after.items() if k.endswith(":momentum_buffer"))
    for how, name in (("flipped", "__2_0.distcp"), ("missing", "__3_0.distcp")):
        out[how] = _load_outcome(_damaged(root, 3, name, how))
    out["full_disk"] = _full_disk(root, model, opt)
    return out


def _full_disk(root: Path, model: Any, opt: Any) -> tuple[str, str, list[int]]:
    """Rank 2 cannot read its files back (ENOSPC while checksumming): every rank raises."""
    real = helpers.file_record

    def full(path: Path) -> dict[str, int]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    if dist.get_rank() == 2:
        helpers.file_record = full
    try:
        ckpt.save_checkpoint(root, 4, model, opt)
        return "ok", "", ckpt.complete_steps(root)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e), ckpt.complete_steps(root)
    finally:
        helpers.file_record = real


def die_mid_save(root: str) -> None:
    model, opt = build("stages", seed=0)
    train(model, opt, range(1))
    ckpt.save_checkpoint(root, 1, model, opt)
    train(model, opt, range(1, 2))
    if dist.get_rank() == 3:

        def die(path: Path) -> dict[str, int]:
            os._exit(17)

        helpers.file_record = die
    ckpt.save_checkpoint(root, 2, model, opt)


# The ranks' runs, a background job on a pool of its own (tests/harness/background.py, ``apart``).
stage_promises = background.apart("stage_promises", promises, 4, timeout=TIMEOUT, in_folder=True)
