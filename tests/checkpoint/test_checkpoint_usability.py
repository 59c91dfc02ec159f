"""What a new user trips on with the checkpoint helpers: a weights-only load of a checkpoint saved
with an optimizer, and DCP's single-process warning on every save and load in one process."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, state_copy, trained_net

TIMEOUT = 120.0  # seconds per multi-rank call
SINGLE = "assuming the intent is to"  # DCP: "... is to save / load in a single process"


def test_weights_only_load_of_a_checkpoint_saved_with_an_optimizer(tmp_path: Path) -> None:
    model, opt = trained_net()
    save_checkpoint(tmp_path, 1, model, opt, extra={"data_step": 1})
    fresh, _ = trained_net(seed=1)
    assert load_checkpoint(tmp_path, fresh) == {"step": 1, "data_step": 1}
    saved, loaded = state_copy(model), state_copy(fresh)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_full_load_still_checks_the_optimizer(tmp_path: Path) -> None:
    model, _ = trained_net()
    save_checkpoint(tmp_path, 1, model)  # weights only
    fresh, opt = trained_net(seed=1)
    with pytest.raises(CheckpointError, match=r"Missing from the checkpoint: optimizer\.state\."):
        load_checkpoint(tmp_path, fresh, opt)
    save_checkpoint(tmp_path, 2, model, Muon(split_params(model), lr=0.02))
    other = Muon(split_params(fresh, adamw=["layers.3.weight"]), lr=0.02)  # other state keys
    with pytest.raises(CheckpointError, match="does not match this model and optimizer"):
        load_checkpoint(tmp_path, fresh, other)


def test_weights_only_load_still_checks_the_weights(tmp_path: Path) -> None:
    model, opt = trained_net()
    save_checkpoint(tmp_path, 1, model, opt)
    wider = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(
        CheckpointError,
        match=r"does not match this model\. Nothing was loaded\. Missing from the checkpoint: 0\.",
    ):
        load_checkpoint(tmp_path, wider)


def _save_then_load_weights(root: str) -> dict[str, Any]:
    """Rank function: save model + optimizer on an FSDP model, load the weights only into another."""
    model = build((2,), seed=0)
    opt = Muon(split_params(model), lr=0.02)
    save_checkpoint(root, 3, model, opt)
    fresh = build((2,), seed=1)
    info = load_checkpoint(root, fresh)
    same = all(torch.equal(full(a), full(b)) for a, b in zip(model.parameters(), fresh.parameters()))
    return {"info": info, "same": same}


def test_weights_only_load_on_two_ranks(tmp_path: Path) -> None:
    for result in run_ranks(_save_then_load_weights, 2, str(tmp_path), timeout=TIMEOUT):
        assert result == {"info": {"step": 3}, "same": True}


def _other_warning(original: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        warnings.warn("another warning from DCP", UserWarning, stacklevel=2)
        return original(*args, **kwargs)

    return wrapped


def test_single_process_save_and_load_do_not_warn_but_other_warnings_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dcp, "save", _other_warning(dcp.save))
    monkeypatch.setattr(dcp, "load", _other_warning(dcp.load))
    model, opt = trained_net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(tmp_path, 1, model, opt)
        load_checkpoint(tmp_path, model, opt)
        load_checkpoint(tmp_path, model)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if SINGLE in m], messages
    assert messages.count("another warning from DCP") == 3, messages


def test_dcp_itself_still_warns_outside_the_helpers(tmp_path: Path) -> None:
    """The filter is scoped to the helpers: a plain ``dcp.save`` afterwards still warns."""
    model, _ = trained_net()
    save_checkpoint(tmp_path / "a", 1, model)
    with pytest.warns(UserWarning, match=SINGLE):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "b"))
