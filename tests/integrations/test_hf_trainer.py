"""``transformers.Trainer`` with FSDP2 through accelerate, on 2 CPU ranks (gloo), with one
muon_dtensor optimizer: train, let the Trainer save ``checkpoint-N``, resume in new processes.

The Trainer refuses ``optimizers=(...)`` under FSDP, so Muon comes in through
``optimizer_cls_and_kwargs`` as the factory ``muon_dtensor.integrations.hf.MuonForTrainer`` (transformers' hook
for Muon-like optimizers): it gets the plain model, builds the param groups with ``split_params``,
and accelerate then swaps the parameters for the DTensors ``fully_shard`` made (``Muon`` follows,
tests/integrations/test_accelerate.py). On CPU accelerate drops its FSDP plugin; ``muon_dtensor.integrations.hf.FsdpOnCpu``
puts it back, as accelerate does on a GPU (accelerate's GPU-only decision itself is not tested).

accelerate saves an FSDP2 optimizer with ``get_optimizer_state_dict(model, opt)``: under
``SHARDED_STATE_DICT`` as DCP files (``optimizer_0/``), every rank writing its shards; under
``FULL_STATE_DICT`` gathered to full tensors that rank 0 saves with ``torch.save``
(``optimizer.bin``) and, on load, broadcasts back into the shards. Both are checked: the momentum
after the resume is the momentum at the save, bit for bit, and the resumed run ends where the
uninterrupted one ends, bit for bit.

Each run is a ``tests.harness.ranks.run_apart`` call, on a pool of its own: accelerate reads RANK,
WORLD_SIZE etc. from the environment and keeps process-wide state. Skipped without transformers/accelerate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from muon_dtensor.integrations.hf import FsdpOnCpu, MuonForTrainer
from tests.harness import background
from tests.harness.ranks import run_apart
from tests.helpers.models import full

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.integration
Trainer: Any = transformers.Trainer
TrainerCallback: Any = transformers.TrainerCallback

TOTAL, SAVED = 4, 2  # Trainer steps; the checkpoint resumed from
KINDS = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
Snapshot = dict[str, torch.Tensor]


@background.job("trainer_runs")
def _trainer_runs(folder: Path) -> tuple[Any, Path]:
    """``train_and_save`` then ``resume``, each on 2 ranks of a pool of their own (accelerate keeps
    state per process), beside the session's tests (tests/harness/background.py, ``run_apart``); what
    the ranks return, and their checkpoints' folder ``folder / "ckpt"``."""
    root = folder / "ckpt"
    root.mkdir()
    first = run_apart(train_and_save, 2, str(root), timeout=240)
    return (first, run_apart(resume, 2, str(root), timeout=240)), root


@pytest.fixture
def trainer_runs() -> tuple[Any, Path]:
    return background.result("trainer_runs")


@pytest.mark.slow
def test_trainer_fsdp2_resumes_momentum_and_run_exactly(trainer_runs: tuple[Any, Path]) -> None:
    (first, second), tmp_path = trainer_runs
    # accelerate's two formats for the optimizer: DCP shards, or one full file from rank 0
    saved_as = {"SHARDED_STATE_DICT": "optimizer_0/.metadata", "FULL_STATE_DICT": "optimizer.bin"}
    for kind, name in saved_as.items():
        assert (tmp_path / kind / f"checkpoint-{SAVED}" / name).is_file(), (kind, name)
    for rank in range(2):
        for kind in KINDS:
            straight, resumed = first[rank][kind], second[rank][kind]
            assert straight["problems"] == resumed["problems"] == [], (rank, kind, resumed["problems"])
            saved, loaded = straight["at_save"], resumed["loaded"]
            assert saved.keys() == loaded.keys() and len(saved) > 0
            differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
            assert differ == [], f"{kind}, rank {rank}: momentum not restored at {differ}"
            assert any(v.abs().sum() > 0 for v in saved.values())  # real momentum, not zeros
            end, resumed_end = straight["at_end"], resumed["at_end"]
            differ = [k for k in end if not torch.equal(end[k], resumed_end[k])]
            assert differ == [], f"{kind}, rank {rank}: resumed run differs at {differ}"
            assert resumed["losses"] == straight["losses"][SAVED:], kind
            assert straight["losses"][-1] < straight["losses"][0], straight["losses"]


# Rank functions (each call on a pool of its own: tests.harness.ranks.run_apart).


class Counting(torch.utils.data.Dataset):
    """Sequences that count up by 1 to 3 from a random start, mod 64: learnable in a few steps."""

    def __init__(self, size: int = 32, seq: int = 16) -> None:
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, 64, (size, 1), generator=gen)
        self.ids = (start + torch.arange(seq) * torch.randint(1, 4, (size, 1), generator=gen)) % 64

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> nn.Module:
    from tests.integrations.test_hf_llama import config  # the same tiny Llama

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    model.config._attn_implementation = "eager"
    return model


class Recorder(TrainerCallback):
    """Optimizer state (full tensors, a collective on every rank) at the save and after a resume's
    load, per-step losses, and parameters and optimizer state at the end."""

    def __init__(self) -> None:
        self.at_save: Snapshot = {}
        self.loaded: Snapshot = {}
        self.at_end: Snapshot = {}
        self.losses: list[float] = []
        self.problems: list[str] = []

    def _momentum(self, model: nn.Module, opt: Any) -> Snapshot:
        muon = opt.optimizer  # accelerate's AcceleratedOptimizer around ours
        out = {}
        for name, p in model.named_parameters():
            if p not in muon.state:
                self.problems.append(name)  # state must follow the model's current parameters
                continue
            for key, value in muon.state[p].items():
                sharded = isinstance(value, DTensor) and value.placements == getattr(p, "placements", None)
                if value.ndim and not sharded:
                    self.problems.append(f"{name}:{key} not a DTensor laid out like its FSDP2 parameter")
                out[f"{name}:{key}"] = full(value).clone()
        return out

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == SAVED:  # a resume: the checkpoint is loaded by now
            self.loaded = self._momentum(kw["model"], kw["optimizer"])

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == SAVED:
            self.at_save = self._momentum(kw["model"], kw["optimizer"])

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model = kw["model"]
        self.at_end = self._momentum(model, kw["optimizer"])
        self.at_end.update({n: full(p.detach()).clone() for n, p in model.named_parameters()})


class CpuFsdpTrainer(FsdpOnCpu, Trainer):
    """The Trainer with FSDP2 kept on CPU ranks (accelerate drops it there; ``muon_dtensor.integrations.hf``)."""


def _run(root: str, kind: str, resume_from: str | None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    # What torchrun would set; the process group itself is already up (gloo).
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    args = transformers.TrainingArguments(
        output_dir=str(Path(root) / kind),
        max_steps=TOTAL,
        save_strategy="steps",
        save_steps=SAVED,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        fsdp=True,
        fsdp_config={"version": 2, "state_dict_type": kind, "reshard_after_forward": True},
        disable_tqdm=True,
        seed=0,
    )
    recorder = Recorder()
    trainer = CpuFsdpTrainer(
        model=_model(),
        args=args,
        train_dataset=Counting(),
        optimizer_cls_and_kwargs=(MuonForTrainer, {"lr": 0.02, "adamw_options": {"lr": 3e-3}}),
        callbacks=[recorder],
    )
    trainer.train(resume_from_checkpoint=resume_from)
    return {k: getattr(recorder, k) for k in ("at_save", "loaded", "at_end", "losses", "problems")}


def train_and_save(root: str) -> dict[str, dict[str, Any]]:
    return {kind: _run(root, kind, None) for kind in KINDS}


def resume(root: str) -> dict[str, dict[str, Any]]:
    return {kind: _run(root, kind, str(Path(root) / kind / f"checkpoint-{SAVED}")) for kind in KINDS}
