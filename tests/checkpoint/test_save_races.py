"""Two saves of one step into one root never share a folder, and the second cannot replace or merge
into the first's published step.

Regression: every save of step N wrote into the fixed ``.tmp_step_N``, so two jobs saving N into
one root at once wrote into one folder; one job's save returned and its published step then failed
verification. Here job B runs a whole save of the same step while job A's shards wait to be
published (A's ``dcp.save`` runs B before returning), in one process.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import muon_dtensor.checkpoint.save as helpers
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint
from muon_dtensor.checkpoint.publish import claim, rename_new
from tests.harness.ranks import run_ranks


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


def test_second_save_of_a_step_raises_and_leaves_the_first_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, model_a, model_b = tmp_path / "root", _linear(1), _linear(2)
    real = helpers.dcp.save

    def a_then_b(state: Any, **kwargs: Any) -> Any:
        out = real(state, **kwargs)  # A's shards are written, not yet published
        monkeypatch.setattr(helpers.dcp, "save", real)
        save_checkpoint(root, 3, model_b)  # job B saves the same step, start to end
        return out

    monkeypatch.setattr(helpers.dcp, "save", a_then_b)
    with pytest.raises(FileExistsError, match=r"step_00000003 already exists: another save published"):
        save_checkpoint(root, 3, model_a)
    assert sorted(os.listdir(root)) == ["step_00000003"]  # A's own folder is gone, B's step stays
    loaded = _linear(3)
    assert load_checkpoint(root, loaded) == {"step": 3}
    assert torch.equal(loaded.weight, model_b.weight) and torch.equal(loaded.bias, model_b.bias)


def claims_twice(root: str) -> list[str]:
    names = [claim(Path(root), 7, None)[0].name for _ in range(2)]
    dist.barrier()
    return names


def test_each_save_gets_its_own_folder_agreed_over_the_group(tmp_path: Path) -> None:
    per_rank = run_ranks(claims_twice, 2, str(tmp_path), timeout=60)
    assert per_rank[0] == per_rank[1], per_rank  # one folder per save, the same on every rank
    first, second = per_rank[0]
    assert first != second
    for name in (first, second):
        assert re.fullmatch(r"\.tmp_step_00000007_[0-9a-f]{12}", name), name
        assert (tmp_path / name).is_dir()


def test_publish_never_replaces_or_merges(tmp_path: Path) -> None:
    tmp, final = tmp_path / ".tmp_step_00000001_x", tmp_path / "step_00000001"
    tmp.mkdir()
    (tmp / "mine").write_text("new")
    final.mkdir()
    (final / "theirs").write_text("old")
    with pytest.raises(FileExistsError, match="step_00000001 already exists"):
        rename_new(tmp, final)
    assert os.listdir(final) == ["theirs"] and os.listdir(tmp) == ["mine"]
    final.rename(tmp_path / "elsewhere")
    rename_new(tmp, final)
    assert os.listdir(final) == ["mine"] and not tmp.exists()
