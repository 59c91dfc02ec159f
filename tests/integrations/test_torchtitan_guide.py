"""docs/torchtitan.md's "Checkpoints both ways", run as written: its three ``python`` blocks on 2 gloo
ranks (FSDP2), with torchtitan's container, schedulers and ``CheckpointManager`` built as
tests/integrations/test_torchtitan.py builds them (the trainer itself cannot run here; that file says why).

Each direction loads into a fresh model and stack (other initial weights), checks every parameter,
momentum buffer and AdamW moment bit for bit, the schedulers' ``last_epoch`` and the train state,
then takes steps 4 and 5: they equal the uninterrupted run's, so the learning-rate schedule came back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.harness.ranks import run_ranks
from tests.helpers.models import build
from tests.integrations.test_torchtitan import (
    SAVE_AT,
    STEPS,
    TrainState,
    checkpointer,
    differences,
    needs_titan,
    snapshot,
    titan_stack,
    train,
)

pytestmark = [needs_titan, pytest.mark.integration]
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md"
TIMEOUT = 240.0


def blocks() -> list[str]:
    """The section's ``python`` blocks: torchtitan's folder loaded, our save, our load into torchtitan."""
    section = GUIDE.read_text().split("## Checkpoints both ways", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert len(found) == 3, "docs/torchtitan.md: 3 python blocks expected; update this test with the page"
    return found


def run_block(i: int, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(blocks()[i], f"docs/torchtitan.md, checkpoints block {i}", "exec"), namespace)  # noqa: S102
    return namespace


def test_a_torchtitan_folder_loads_as_the_page_says(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(titan_folder_to_helpers, 2, str(tmp_path), timeout=TIMEOUT)):
        assert r["restored"] == [] and r["resumed"] == [], (rank, r)
        assert r["info"] == {"step": SAVE_AT, "lr_scheduler": {"last_epoch": SAVE_AT}}, r["info"]
        assert r["train_state"] == {"step": SAVE_AT} and r["trainer_step"] == SAVE_AT
        assert r["last_epoch"] == SAVE_AT


def test_a_helpers_folder_loads_into_torchtitan_as_the_page_says(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(helpers_to_titan_manager, 2, str(tmp_path), timeout=TIMEOUT)):
        assert r["restored"] == [] and r["resumed"] == [], (rank, r)
        assert r["info"] == {
            "step": SAVE_AT,
            "lr_scheduler": {"last_epoch": SAVE_AT},
            "train_state": {"step": SAVE_AT},
        }, r["info"]
        assert r["train_state"] == SAVE_AT and r["last_epoch"] == SAVE_AT


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _trained(folder: str, save: bool) -> tuple[Any, Any, Any, Any, Any]:
    """A stack trained 3 steps (torchtitan saving at step 3 when ``save``), its snapshot at step 3,
    and the uninterrupted run's snapshot after step 5."""
    model = build((dist.get_world_size(),))
    optimizers, schedulers = titan_stack(model, "muon")
    manager = checkpointer(folder, model, optimizers, schedulers)
    train(model, optimizers, schedulers, range(SAVE_AT), manager if save else None)
    manager.states["train_state"].step = SAVE_AT
    return model, optimizers, schedulers, manager, snapshot(optimizers)


def _resumed(model: Any, optimizers: Any, schedulers: Any, saved: Any, twin: Any) -> dict[str, Any]:
    restored = differences(saved, snapshot(optimizers))
    last_epoch = schedulers.schedulers[0].last_epoch
    train(model, optimizers, schedulers, range(SAVE_AT, STEPS))
    return {
        "restored": restored,
        "resumed": differences(twin, snapshot(optimizers)),
        "last_epoch": last_epoch,
    }


def _twin(model: Any, optimizers: Any, schedulers: Any) -> Any:
    train(model, optimizers, schedulers, range(SAVE_AT, STEPS))
    return snapshot(optimizers)


def titan_folder_to_helpers(folder: str) -> dict[str, Any]:
    """torchtitan's manager saves step 3; the page's first block loads the folder into a fresh stack."""
    model, optimizers, schedulers, manager, saved = _trained(folder, save=True)
    manager.close()
    twin = _twin(model, optimizers, schedulers)
    fresh = build((dist.get_world_size(),), seed=1)
    fresh_optimizers, fresh_schedulers = titan_stack(fresh, "muon")
    trainer = TrainState()
    namespace = {
        "titan_folder": Path(folder) / "checkpoint",
        "model_parts": [fresh],
        "optimizers": fresh_optimizers,
        "lr_schedulers": fresh_schedulers,
        "trainer": trainer,
    }
    info = run_block(0, namespace)["info"]
    out = _resumed(fresh, fresh_optimizers, fresh_schedulers, saved, twin)
    # the manager here has no dataloader (None): its entry is left out of the comparison
    shown = {k: v for k, v in info.items() if k not in ("dataloader", "train_state")}
    return out | {"info": shown, "train_state": info["train_state"], "trainer_step": trainer.step}


def helpers_to_titan_manager(folder: str) -> dict[str, Any]:
    """The page's second block saves the trained stack's manager; its third loads the root into a
    fresh stack's manager."""
    model, optimizers, schedulers, manager, saved = _trained(folder, save=False)
    root = Path(folder) / "ours"
    run_block(1, {"root": root, "checkpointer": manager})
    manager.close()
    twin = _twin(model, optimizers, schedulers)
    fresh = build((dist.get_world_size(),), seed=1)
    fresh_optimizers, fresh_schedulers = titan_stack(fresh, "muon")
    fresh_manager = checkpointer(str(Path(folder) / "fresh"), fresh, fresh_optimizers, fresh_schedulers)
    info = run_block(2, {"root": root, "checkpointer": fresh_manager})["info"]
    train_state = fresh_manager.states["train_state"].step
    fresh_manager.close()
    out = _resumed(fresh, fresh_optimizers, fresh_schedulers, saved, twin)
    return out | {"info": info, "train_state": train_state}
