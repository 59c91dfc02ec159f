"""One checkpoint for every stage layout, through the helpers (``save_checkpoint``/``load_checkpoint``
with model parts): saved by 2 stages x 2 FSDP2 shards on 4 ranks, it resumes on the same stages, on 4
stages, with HSDP or TP inside a stage, merged on 2 ranks without pipeline parallelism (and back),
and as two model parts per rank (virtual stages, lists of parts and optimizers). Each resumed run
must hold the saved state and continue bit for bit as the uninterrupted run: every layout steps on
the same synthetic gradients (``tests.helpers.stage_layouts``), and every step is bitwise one process, so
the reference is one process. The real schedule (GPipe's backward) resumes merged in
``test_a_real_pipeline_resumes_merged``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.harness import background
from tests.harness.ranks import run_apart, run_ranks
from tests.helpers.pipeline import Pipeline, differences, reference_train, shard, snapshot, stack
from tests.helpers.stage_layouts import build, cut, train

TIMEOUT = 120.0  # one 4-rank call of several layouts on 2 busy cores takes about 20 s
SPLIT, TOTAL = 2, 3  # saved after SPLIT steps, resumed for one more
Snapshot = dict[str, torch.Tensor]


@functools.cache
def reference() -> tuple[Snapshot, Snapshot]:
    """One process, the whole model: its parameters and state after SPLIT and after TOTAL steps."""
    model = stack(0)
    opt = Muon(split_params(model), lr=0.02)
    train(model, opt, range(SPLIT))
    saved = snapshot(model, opt)
    train(model, opt, range(SPLIT, TOTAL))
    return saved, snapshot(model, opt)


@background.job("stage_runs")
def _stage_runs(folder: Path) -> tuple[Path, list[dict[str, Any]]]:
    """``stages_everywhere`` on 4 ranks of a pool of their own, beside the session's tests
    (tests/harness/background.py, ``run_apart``); the folder keeps its checkpoints."""
    return folder, run_apart(stages_everywhere, 4, str(folder), timeout=TIMEOUT)


stage_runs = background.reader("stage_runs")


@pytest.mark.parametrize("layout", ["saved", "stages", "stages4", "hsdp", "tp", "stages4->stages"])
def test_stages_resume_on_every_stage_layout(
    stage_runs: tuple[Path, list[dict[str, Any]]], layout: str
) -> None:
    _check([r[layout] for r in stage_runs[1]])


def test_stages_resume_merged_and_as_two_parts_per_rank(
    stage_runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    root = stage_runs[0]
    results = run_ranks(on_two_ranks, 2, str(root), timeout=TIMEOUT)
    for layout in ("merged", "parts", "parts->merged"):
        _check([r[layout] for r in results])
    back = run_ranks(merged_back_on_stages, 4, str(root), timeout=TIMEOUT)
    _check(back)


def test_export_of_stages_is_the_whole_model(
    stage_runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Stages' checkpoint exports every stage's weights: the export of the merged run's checkpoint of
    the same step (written by ``on_two_ranks``), tensor for tensor."""
    root = stage_runs[0]
    if not (root / "merged").exists():
        run_ranks(on_two_ranks, 2, str(root), timeout=TIMEOUT)
    stages = ckpt.export_safetensors(root / "a" / "step_00000002", tmp_path / "stages")
    merged = ckpt.export_safetensors(root / "merged" / "step_00000002", tmp_path / "merged")
    a, b = load_file(str(stages[0])), load_file(str(merged[0]))
    assert a.keys() == b.keys() == dict(stack(0).named_parameters()).keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], reference()[0][k]) for k in a)


def test_a_real_pipeline_resumes_merged(tmp_path: Path) -> None:
    """GPipe's schedule on 2 stages x 2 shards saves through the helpers; one model on FSDP2 over 2
    ranks resumes it with the schedule's arithmetic (gradients summed over micro-batches)."""
    stages = run_ranks(schedule_save, 4, str(tmp_path), timeout=TIMEOUT)
    merged = run_ranks(schedule_resume_merged, 2, str(tmp_path), timeout=TIMEOUT)
    saved, straight = (
        {**stages[0]["saved"], **stages[2]["saved"]},
        {**stages[0]["final"], **stages[2]["final"]},
    )
    for rank, r in enumerate(merged):
        assert differences(r["loaded"], saved) == [], f"rank {rank}: changed by save and load"
        assert differences(r["final"], straight) == [], f"rank {rank}: resumed step differs"


def _check(results: list[dict[str, Snapshot]]) -> None:
    """Each rank's part equals the reference: as loaded (or saved), and after the resumed step."""
    saved, final = reference()
    assert sum(len(r["loaded"]) for r in results) >= len(saved), "the parts together hold the model"
    for rank, r in enumerate(results):
        assert r["loaded"] and differences(r["loaded"], saved) == [], f"rank {rank}: not the saved state"
        assert differences(r["final"], final) == [], f"rank {rank}: the resumed step differs"


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _resumed(layout: str, folder: Path) -> dict[str, Snapshot]:
    model, opt = build(layout, seed=5)  # other initial weights: the load must replace them
    assert ckpt.load_checkpoint(folder, model, opt) == {"step": SPLIT}
    loaded = snapshot(model, opt)
    train(model, opt, range(SPLIT, TOTAL))
    return {"loaded": loaded, "final": snapshot(model, opt)}


def _saved(layout: str, folder: Path) -> dict[str, Snapshot]:
    model, opt = build(layout, seed=0)
    train(model, opt, range(SPLIT))
    ckpt.save_checkpoint(folder, SPLIT, model, opt)
    loaded = snapshot(model, opt)
    train(model, opt, range(SPLIT, TOTAL))
    return {"loaded": loaded, "final": snapshot(model, opt)}


def stages_everywhere(root: str) -> dict[str, dict[str, Snapshot]]:
    """Save on 2 stages x 2 shards (folder a), resume on each 4-rank layout; save on 4 stages
    (folder b), resume on 2 stages."""
    out = {"saved": _saved("stages", Path(root) / "a")}
    for layout in ("stages", "stages4", "hsdp", "tp"):
        out[layout] = _resumed(layout, Path(root) / "a")
    _saved("stages4", Path(root) / "b")
    out["stages4->stages"] = _resumed("stages", Path(root) / "b")
    return out


def _two_parts(seed: int) -> tuple[list[Any], list[Muon]]:
    """Virtual stages: 4 stages of one layer, rank r holding stages r and r + 2, plain tensors."""
    whole = stack(seed)
    parts = [cut(whole, 4, dist.get_rank() + 2 * i) for i in range(2)]
    return parts, [Muon(split_params(p), lr=0.02) for p in parts]


def _snapshots(parts: list[Any], opts: list[Muon]) -> Snapshot:
    return {k: v for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}


def on_two_ranks(root: str) -> dict[str, dict[str, Snapshot]]:
    """On 2 ranks: the stages' checkpoint merged (FSDP2 over both, folder merged saved too) and as
    two parts per rank; the parts' own checkpoint (folder parts) merged."""
    out = {"merged": _resumed("merged", Path(root) / "a")}
    _saved("merged", Path(root) / "merged")
    parts, opts = _two_parts(seed=5)
    assert ckpt.load_checkpoint(Path(root) / "a", parts, opts) == {"step": SPLIT}
    loaded = _snapshots(parts, opts)
    for p, o in zip(parts, opts):
        train(p, o, range(SPLIT, TOTAL))
    out["parts"] = {"loaded": loaded, "final": _snapshots(parts, opts)}
    parts, opts = _two_parts(seed=0)
    for p, o in zip(parts, opts):
        train(p, o, range(SPLIT))
    ckpt.save_checkpoint(Path(root) / "parts", SPLIT, parts, opts)
    out["parts->merged"] = _resumed("merged", Path(root) / "parts")
    return out


def merged_back_on_stages(root: str) -> dict[str, Snapshot]:
    return _resumed("stages", Path(root) / "merged")


def schedule_save(root: str) -> dict[str, Snapshot]:
    pipe = Pipeline()
    pipe.train(range(SPLIT))
    ckpt.save_checkpoint(root, SPLIT, pipe.model, pipe.opt)
    saved = snapshot(pipe.model, pipe.opt)
    pipe.train(range(SPLIT, TOTAL))
    return {"saved": saved, "final": snapshot(pipe.model, pipe.opt)}


def schedule_resume_merged(root: str) -> dict[str, Snapshot]:
    from torch.distributed.device_mesh import init_device_mesh

    model = shard(stack(5), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    opt = Muon(split_params(model), lr=0.02)
    ckpt.load_checkpoint(root, model, opt)
    loaded = snapshot(model, opt)
    reference_train(model, opt, range(SPLIT, TOTAL))  # FSDP's backward, the pipeline's micro-batches
    return {"loaded": loaded, "final": snapshot(model, opt)}
