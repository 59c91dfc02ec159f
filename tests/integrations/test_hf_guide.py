"""docs/hf_trainer.md, run as written: its three ``python`` blocks, each run on a pool of its own
(``run_apart``: accelerate keeps process-wide state). The page's ``model`` and ``train_dataset``
("yours") are the tiny Llama and counting data of tests/integrations/test_hf_trainer.py.

The FSDP2 block runs on 2 CPU ranks (gloo) with ``transformers.Trainer`` replaced by the page's own
``CpuFsdpTrainer`` block, which keeps FSDP on, as accelerate does on GPUs; without it accelerate
would train DDP here and the FSDP2 form would go unchecked."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon
from tests.harness.ranks import run_apart

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.integration

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "hf_trainer.md"


def blocks() -> list[str]:
    """The ``python`` blocks of the guide, in order: the optimizer form, the factory, the CPU mixin."""
    found = re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), re.S | re.M)
    assert len(found) == 3, "docs/hf_trainer.md: 3 python blocks expected; update this test with the page"
    return found


def test_guide_blocks_compile() -> None:
    for i, block in enumerate(blocks()):
        compile(block, f"docs/hf_trainer.md, python block {i}", "exec")


@pytest.mark.slow
def test_optimizer_form_trains_in_one_process(tmp_path: Path) -> None:
    (out,) = run_apart(run_block, 1, str(tmp_path), [0], timeout=240)
    assert out["optimizer"] == "Muon" and not out["fsdp"] and not out["dtensors"]
    assert out["groups"] == [("muon", False), ("adamw", True)], out["groups"]
    assert len(out["losses"]) == 4 and out["losses"][-1] < out["losses"][0], out["losses"]


@pytest.mark.slow
def test_factory_form_trains_fsdp2_on_two_ranks(tmp_path: Path) -> None:
    per_rank = run_apart(run_block, 2, str(tmp_path), [2, 1], timeout=300)
    for out in per_rank:
        assert out["optimizer"] == "Muon" and out["fsdp"] and out["dtensors"], out
        assert out["groups"] == [("muon", False), ("adamw", True)], out["groups"]
        assert out["adamw_lr_at_start"] == 3e-3 and out["weight_decay"] == 0.1
        assert len(out["losses"]) == 4 and out["losses"][-1] < out["losses"][0], out["losses"]
        assert out["finite"]
    assert (tmp_path / "runs" / "hf-muon-fsdp2" / "checkpoint-4" / "optimizer_0" / ".metadata").is_file()


# Rank functions (each call on a pool of its own, tests.harness.ranks.run_apart).


def run_block(root: str, order: list[int]) -> dict[str, Any]:
    """Run the guide's blocks ``order`` (the last one trains) in ``root``; what the trainer holds."""
    from tests.integrations.test_hf_trainer import Counting, _model

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.chdir(root)
    namespace: dict[str, Any] = {"model": _model(), "train_dataset": Counting()}
    losses: list[float] = []
    base = transformers.Trainer
    base.training_step = _recording(base.training_step, losses)  # this rank's loss of each step
    for i in order:
        if i == 1:  # the FSDP2 block: its `from transformers import Trainer` gets the CPU mixin's Trainer
            # (transformers swaps its module in sys.modules once loaded: patch the one imports read)
            sys.modules["transformers"].Trainer = namespace["CpuFsdpTrainer"]  # type: ignore[attr-defined]
            os.environ["ACCELERATE_USE_CPU"] = "true"  # as the page says for CPU ranks
        exec(compile(blocks()[i], f"docs/hf_trainer.md block {i}", "exec"), namespace)  # noqa: S102
    trainer = namespace["trainer"]
    muon = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    return {
        "optimizer": type(muon).__name__ if isinstance(muon, Muon) else repr(muon),
        "fsdp": trainer.is_fsdp_enabled,
        "dtensors": all(isinstance(p, DTensor) for p in trainer.model.parameters()),
        "groups": [(g["algorithm"], any(p.ndim < 2 for p in g["params"])) for g in muon.param_groups],
        "adamw_lr_at_start": muon.param_groups[-1]["initial_lr"],
        "weight_decay": muon.param_groups[0]["weight_decay"],
        "losses": losses,
        "finite": all(torch.isfinite(p).all() for p in trainer.model.parameters()),
    }


def _recording(training_step: Any, losses: list[float]) -> Any:
    def recorded(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = training_step(self, *args, **kwargs)
        losses.append(float(loss))
        return loss

    return recorded
