"""Checkpoints move between torchtitan's ``CheckpointManager`` and the helpers, both ways: the format
is torchtitan's own (model FQNs at the top level, the optimizer under ``optimizer.`` keyed per
parameter), so a folder either one writes loads in the other, weights and momentum bit for bit.

torchtitan's trainer cannot run here (tests/integrations/test_torchtitan.py says why); these tests drive its
container, schedulers and ``CheckpointManager`` on CPU and gloo, as that file does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import build
from tests.integrations.test_torchtitan import (
    SAVE_AT,
    checkpointer,
    differences,
    needs_titan,
    snapshot,
    titan_stack,
    train,
)

pytestmark = [needs_titan, pytest.mark.integration]
TIMEOUT = 180.0


def test_a_torchtitan_checkpoint_loads_through_load_checkpoint(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(titan_to_helpers, 2, str(tmp_path), timeout=TIMEOUT)):
        # torchtitan's entries beside the weights come back as plain data (no dataloader here: None)
        expected = {
            "step": SAVE_AT,
            "lr_scheduler": {"last_epoch": SAVE_AT},
            "train_state": {"step": SAVE_AT},
        }
        assert {k: v for k, v in r["step"].items() if k != "dataloader"} == expected, r["step"]
        assert r["latest"] == SAVE_AT, (rank, r)
        assert r["restored"] == [] and r["entries"] == 5 * 2 + 7 * 4, (rank, r["restored"])


def test_a_helpers_checkpoint_loads_in_torchtitans_container(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(helpers_to_titan, 2, str(tmp_path), timeout=TIMEOUT)):
        assert r["loaded"] is True and r["restored"] == [], (rank, r["restored"])
        assert r["entries"] == 5 * 2 + 7 * 4, r["entries"]


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def titan_to_helpers(folder: str) -> dict[str, Any]:
    """torchtitan's container and CheckpointManager save step 3 (``checkpoint/step-3``); a fresh
    model (other weights) and a plain ``Muon`` load it through ``load_checkpoint``."""
    model = build((dist.get_world_size(),))
    optimizers, schedulers = titan_stack(model, "muon")
    manager = checkpointer(folder, model, optimizers, schedulers)
    train(model, optimizers, schedulers, range(SAVE_AT), manager)
    saved = snapshot(optimizers)
    manager.close()
    fresh = build((dist.get_world_size(),), seed=1)
    opt = Muon(split_params(fresh), lr=0.5)
    root = Path(folder) / "checkpoint"
    out = {"latest": ckpt.latest_step(root), "step": ckpt.load_checkpoint(root, fresh, opt)}
    return out | {"restored": differences(saved, snapshot([opt])), "entries": len(saved)}


def helpers_to_titan(folder: str) -> dict[str, Any]:
    """``save_checkpoint`` saves the model and the container's Muon at step 3; a fresh model and
    container load the step folder through torchtitan's ``CheckpointManager`` (``initial_load_path``
    with ``initial_load_model_only=False``; the schedule and train state, which the helpers keep
    elsewhere, excluded from loading)."""
    model = build((dist.get_world_size(),))
    optimizers, schedulers = titan_stack(model, "muon")
    train(model, optimizers, schedulers, range(SAVE_AT))
    saved = snapshot(optimizers)
    step = ckpt.save_checkpoint(Path(folder) / "ours", SAVE_AT, model, list(optimizers.optimizers))
    fresh = build((dist.get_world_size(),), seed=1)
    fresh_optimizers, fresh_schedulers = titan_stack(fresh, "muon")
    manager = checkpointer(folder, fresh, fresh_optimizers, fresh_schedulers)
    manager.initial_load_path, manager.initial_load_model_only = str(step), False
    manager.exclude_from_loading = [
        k for k in manager.states if k in ("dataloader", "lr_scheduler", "train_state")
    ]
    loaded = manager.load()
    manager.close()
    return {
        "loaded": loaded,
        "restored": differences(saved, snapshot(fresh_optimizers)),
        "entries": len(saved),
    }
