"""Checkpoints across a pipeline merge: saved by 2 stages x 2 FSDP2 shards (4 ranks, one Muon per
stage), resumed by one model on FSDP2 over 2 ranks with one Muon, and back.

The recipe (docs/torchtitan.md, "Pipeline parallelism"): each rank saves its part with
``torch.distributed.checkpoint`` and per-parameter optimizer keys
(``flatten_optimizer_state_dict=True``, as torchtitan's optimizer container does), so the stages'
entries never collide and any grouping of the parameters loads them. The resumed step must equal
the uninterrupted run's bit for bit (both see the same batches; every run here is bitwise one
process). ``muon_dtensor.checkpoint.save_checkpoint`` keys param groups by index: it refuses stage
optimizers on every rank before writing anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from tests.pipeline import Pipeline, differences, muon, reference_train, shard, snapshot, stack
from tests.ranks import run_ranks

TIMEOUT = 90.0  # one 4-rank call on 2 busy cores takes about 10 s
SPLIT, TOTAL = 2, 3  # saved after SPLIT steps, resumed for one more
PER_FQN = StateDictOptions(flatten_optimizer_state_dict=True)
Snapshot = dict[str, torch.Tensor]


def test_stages_resume_merged(tmp_path: Path) -> None:
    stages = run_ranks(stages_save, 4, str(tmp_path), timeout=TIMEOUT)
    merged = run_ranks(merged_resume, 2, str(tmp_path), timeout=TIMEOUT)
    _check(saved=_union(stages, "saved"), straight=_union(stages, "final"), resumed=merged)


def test_merged_resumes_on_stages(tmp_path: Path) -> None:
    merged = run_ranks(merged_save, 2, str(tmp_path), timeout=TIMEOUT)
    stages = run_ranks(stages_resume, 4, str(tmp_path), timeout=TIMEOUT)
    for rank, r in enumerate(stages):  # each stage holds its part: the merged run's entries of that part
        part = {k: v for k, v in merged[0]["final"].items() if k in r["final"]}
        assert len(part) == (16 if rank < 2 else 24), rank
        _check(saved=merged[0]["saved"], straight=part, resumed=[r])


def test_save_checkpoint_refuses_stage_optimizers(tmp_path: Path) -> None:
    for rank, message in enumerate(run_ranks(stages_save_helpers, 4, str(tmp_path), timeout=TIMEOUT)):
        assert "ranks' optimizers hold different param groups" in message, (rank, message)
        assert "'group 0: 2 parameter(s), the first layers.0.weight" in message, message
        assert "'group 0: 2 parameter(s), the first layers.2.weight" in message, message
        assert "on ranks 0, 1" in message and "on ranks 2, 3" in message, message
        assert "flatten_optimizer_state_dict=True" in message, message
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary folder


def _union(results: list[dict[str, Any]], key: str) -> Snapshot:
    """The full model's entries from a stage run: stage 0's (rank 0) and stage 1's (rank 2)."""
    return {**results[0][key], **results[2][key]}


def _check(saved: Snapshot, straight: Snapshot, resumed: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(resumed):
        assert set(r["loaded"]) <= set(saved) and set(r["final"]) == set(straight), rank
        assert differences(r["loaded"], saved) == [], f"rank {rank}: changed by save and load"
        assert differences(r["final"], straight) == [], f"rank {rank}: resumed step differs"
    assert any(k.endswith(":momentum_buffer") for k in straight) and any(
        k.endswith(":exp_avg") for k in straight
    )


# Rank functions (run by tests.ranks in every rank of the pool).


def save(model: nn.Module, opt: Muon, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=PER_FQN)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(model: nn.Module, opt: Muon, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=PER_FQN)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=PER_FQN
    )


def _merged(seed: int) -> tuple[nn.Module, Muon]:
    """The whole model, fully_shard-ed on a 1-D mesh of the 2 ranks, and one Muon."""
    model = shard(stack(seed), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    return model, muon(model)


def stages_save(root: str) -> dict[str, Snapshot]:
    pipe = Pipeline()
    pipe.train(range(SPLIT))
    save(pipe.model, pipe.opt, root)
    saved = snapshot(pipe.model, pipe.opt)
    pipe.train(range(SPLIT, TOTAL))
    return {"saved": saved, "final": snapshot(pipe.model, pipe.opt)}


def merged_resume(root: str) -> dict[str, Snapshot]:
    model, opt = _merged(seed=5)  # other initial weights: the load must replace them
    load(model, opt, root)
    loaded = snapshot(model, opt)
    reference_train(model, opt, range(SPLIT, TOTAL))  # FSDP's backward, the pipeline's micro-batches
    return {"loaded": loaded, "final": snapshot(model, opt)}


def merged_save(root: str) -> dict[str, Snapshot]:
    model, opt = _merged(seed=0)
    reference_train(model, opt, range(SPLIT))
    save(model, opt, root)
    saved = snapshot(model, opt)
    reference_train(model, opt, range(SPLIT, TOTAL))
    return {"saved": saved, "final": snapshot(model, opt)}


def stages_resume(root: str) -> dict[str, Snapshot]:
    pipe = Pipeline(seed=5)
    load(pipe.model, pipe.opt, root)
    loaded = snapshot(pipe.model, pipe.opt)
    pipe.train(range(SPLIT, TOTAL))
    return {"loaded": loaded, "final": snapshot(pipe.model, pipe.opt)}


def stages_save_helpers(root: str) -> str:
    pipe = Pipeline()
    pipe.train(range(1))
    try:
        ckpt.save_checkpoint(root, 1, pipe.model, pipe.opt)
    except ValueError as e:
        return str(e)
    return "saved"
