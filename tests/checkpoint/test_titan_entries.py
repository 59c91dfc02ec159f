"""torchtitan's entries beside the weights are read and checked before anything is applied (issue 49
item 2).

``load_checkpoint`` read a torchtitan folder's ``lr_scheduler``, ``train_state`` and ``dataloader``
entries after the weights and the optimizer state were applied: a ``train_state`` pickle naming
``os.system`` raised "not plain data ... Nothing was loaded" while every weight already held the
checkpoint's values (no payload ran), and so did a payload in ``lr_scheduler.last_epoch``, a
``dataloader`` entry saved as a raw ``io.BytesIO`` (DCP writes a BytesIO's bytes as they are, not
through ``torch.save``) and entries ``lr_scheduler.a`` beside ``lr_scheduler.a.b`` (a raw
TypeError). A job that caught the error and started fresh trained from the checkpoint's weights
with a fresh optimizer. Now each is a CheckpointError before any weight changes, on every rank.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import muon_dtensor.checkpoint as ckpt
from muon_dtensor.checkpoint.keys import Parts, dcp_state, part_states
from tests.harness.ranks import run_ranks
from tests.helpers.models import state_copy, trained_net


class _System:
    """Unpickling this runs ``mkdir`` through ``os.system``: proof that reading an entry ran code."""

    def __init__(self, marker: Path) -> None:
        self.command = f"mkdir {shlex.quote(str(marker))}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _titan_folder(root: Path, entries: dict[str, Any]) -> Path:
    """A torchtitan checkpoint folder (``step-1``, no manifest) of a trained Net and its Muon, with
    ``entries`` beside them as torchtitan's CheckpointManager saves its other states."""
    model, opt = trained_net(0)
    state = dcp_state(part_states(Parts.of(model, opt), with_optimizer=True)) | entries
    dcp.save(state, checkpoint_id=str(root / "step-1"), no_dist=True)
    return root


def _optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.detach().clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _refused(root: Path, marker: Path) -> tuple[str, bool, bool]:
    """Load ``root`` into another trained Net: the error's text, whether the weights and whether the
    optimizer state are unchanged. The payload must not have run."""
    model, opt = trained_net(1)
    weights, momenta = state_copy(model), _optimizer_state(opt)
    try:
        ckpt.load_checkpoint(root, model, opt)
        message = "no error"
    except ckpt.CheckpointError as e:
        message = str(e)
    assert not marker.exists(), "the checkpoint ran code"
    same_weights = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    same_momenta = all(torch.equal(a, b) for a, b in zip(momenta, _optimizer_state(opt), strict=True))
    return message, same_weights, same_momenta


def _entries(kind: str, marker: Path) -> dict[str, Any]:
    payload = _System(marker)
    kinds: dict[str, dict[str, Any]] = {
        "train_state": {"train_state": {"step": payload}},
        "lr_scheduler.last_epoch": {"lr_scheduler": {"last_epoch": payload, "base_lrs": [0.02]}},
        "raw BytesIO dataloader": {"dataloader": {"dp_rank_0": io.BytesIO(pickle.dumps(payload))}},
        "nesting clash": {"lr_scheduler": {"a": 1, "a.b": 2}},
    }
    return kinds[kind]


KINDS = ["train_state", "lr_scheduler.last_epoch", "raw BytesIO dataloader", "nesting clash"]
EXPECTED = {
    "train_state": "train_state.step",
    "lr_scheduler.last_epoch": "lr_scheduler.last_epoch",
    "raw BytesIO dataloader": "dataloader.dp_rank_0",
    "nesting clash": "the entries 'lr_scheduler.a' and 'lr_scheduler.a.b' clash",
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_titan_entry_is_refused_before_anything_is_applied(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "ran"
    root = _titan_folder(tmp_path / "titan", _entries(kind, marker))
    message, same_weights, same_momenta = _refused(root, marker)
    assert EXPECTED[kind] in message and "Nothing was loaded" in message, message
    assert same_weights and same_momenta, "the load applied state before it refused the folder"


def test_plain_titan_entries_still_load(tmp_path: Path) -> None:
    """The control: plain entries come back nested, and the weights load."""
    loader = pickle.dumps({"position": 7})
    entries = {
        "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.02]},
        "train_state": {"step": 3},
        "dataloader": {"dp_rank_0": loader, "world_size": 1},
    }
    root = _titan_folder(tmp_path / "titan", entries)
    model, opt = trained_net(1)
    loaded = ckpt.load_checkpoint(root, model, opt)
    assert loaded == {"step": 1, **entries}, loaded
    saved, _ = trained_net(0)
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in model.state_dict().items())


def load_on_ranks(root: str, marker: str) -> tuple[str, bool, bool]:
    """Rank function: every rank loads the same torchtitan folder into its own trained Net."""
    assert dist.get_world_size() == 2
    return _refused(Path(root), Path(marker))


def test_a_bad_titan_entry_is_refused_on_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    root = _titan_folder(tmp_path / "titan", _entries("train_state", marker))
    results = run_ranks(load_on_ranks, 2, str(root), str(marker), timeout=120)
    assert len(set(results)) == 1, results
    message, same_weights, same_momenta = results[0]
    assert "train_state.step" in message and same_weights and same_momenta, results[0]
