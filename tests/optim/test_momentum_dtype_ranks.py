"""``momentum_dtype`` on gloo ranks: a sharded step with bf16 momentum is the one-process step with
bf16 momentum, bit for bit (1-D and 2-D meshes, uneven rows, FSDP2); DCP saves the buffer in bf16,
reshards it, and a resume at the same dtype is bitwise; a load into another dtype converts, with a
warning on every rank naming the buffers."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint.manifest import step_dir
from muon_dtensor.checkpoint.safe_read import read_metadata
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, model_grads, step_together
from tests.optim.test_exact import SHAPES, run_steps

TIMEOUT = 240.0
SAVED, TOTAL = 2, 4
LAYOUTS = {  # 1-D row and column shards, and a 2-D mesh (replicated x sharded)
    "fsdp": ((2,), (Shard(0),)),
    "fsdp_dim1": ((2,), (Shard(1),)),
    "hsdp_1x2": ((1, 2), (Replicate(), Shard(0))),
}


def test_sharded_step_with_bf16_momentum_equals_one_process() -> None:
    for rank, per_layout in enumerate(run_ranks(sharded_vs_one_process, 2, timeout=TIMEOUT)):
        assert set(per_layout) == set(LAYOUTS)
        for name, r in per_layout.items():
            assert r["params"] == [] and r["momentum"] == [], (rank, name, r)
            assert r["laid_out"], (
                f"rank {rank} {name}: momentum is not a bf16 DTensor laid out like its param"
            )


def test_bf16_momentum_saves_reshards_and_resumes_bitwise(tmp_path: Path) -> None:
    """Saved on 2 FSDP2 ranks, resumed on 1 and on 2: every run ends bitwise where the one-process
    run with bf16 momentum ends, and the checkpoint holds the buffers in bf16."""
    root = str(tmp_path / "bf16")
    saved = run_ranks(save_after, 2, root, "bfloat16", timeout=TIMEOUT)
    reference = run_ranks(uninterrupted, 1, "bfloat16", timeout=TIMEOUT)[0]
    for r in saved:
        assert r["stored"] == {"torch.bfloat16"}
        assert all(torch.equal(v, reference["at_save"][k]) for k, v in r["state"].items())
    for world in (1, 2):
        for rank, r in enumerate(run_ranks(resume, world, root, "bfloat16", timeout=TIMEOUT)):
            assert r["warnings"] == [], (world, rank, r["warnings"])
            for key, value in reference["final"].items():
                assert torch.equal(r["final"][key], value), f"world {world} rank {rank}: {key} differs"


def test_load_into_another_dtype_converts_on_every_rank_and_warns_once(tmp_path: Path) -> None:
    root = str(tmp_path / "fp32")
    saved = run_ranks(save_after, 2, root, None, timeout=TIMEOUT)[0]["state"]
    for rank, r in enumerate(run_ranks(resume, 2, root, "bfloat16", timeout=TIMEOUT)):
        if rank:  # every rank converts alike: the job prints the warning once, on rank 0
            assert r["warnings"] == [], r["warnings"]
        else:
            (message,) = r["warnings"]
            assert "'layers.0.weight' float32 -> bfloat16" in message, (rank, message)
            assert "momentum_dtype=torch.float32" in message
        assert r["group_dtype"] == "bfloat16"
        for key, value in r["loaded"].items():
            if key.startswith("momentum_buffer:"):
                assert torch.equal(value, saved[key].bfloat16()), (rank, key)
        assert r["final"], "the converted run did not step"


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def sharded_vs_one_process() -> dict[str, Any]:
    out = {}
    ref_params, ref_bufs, _ = run_steps(None, (), 3, momentum_dtype=torch.bfloat16)
    for name, (mesh_shape, placements) in LAYOUTS.items():
        params, bufs, _ = run_steps(mesh_shape, placements, 3, momentum_dtype=torch.bfloat16)
        out[name] = {
            "params": [
                i for i, (p, r) in enumerate(zip(params, ref_params)) if not torch.equal(full(p.detach()), r)
            ],
            "momentum": [i for i, (b, r) in enumerate(zip(bufs, ref_bufs)) if not torch.equal(full(b), r)],
            "laid_out": all(
                isinstance(b, DTensor)
                and b.placements == getattr(p, "placements", None)
                and b.dtype == torch.bfloat16
                for b, p in zip(bufs, params[: len(SHAPES)])
            ),
        }
    return out


def _model(mesh: bool, dtype: str | None, seed: int = 0) -> tuple[nn.Module, Muon]:
    model = build((dist.get_world_size(),) if mesh else None, seed=seed)
    return model, Muon(split_params(model), lr=0.02, momentum_dtype=getattr(torch, dtype) if dtype else None)


def _run(model: nn.Module, opt: Muon, steps: range) -> None:
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), steps)


def _snapshot(model: nn.Module, opt: Muon) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"{k}:{n}": full(v).clone() for k, v in opt.state[p].items()})
    return out


def save_after(root: str, dtype: str | None) -> dict[str, Any]:
    model, opt = _model(True, dtype)
    _run(model, opt, range(SAVED))
    ckpt.save_checkpoint(root, SAVED, model, opt)
    metadata = read_metadata(step_dir(root, SAVED)).state_dict_metadata
    stored = {
        str(cast(TensorStorageMetadata, m).properties.dtype)
        for k, m in metadata.items()
        if k.endswith(".momentum_buffer")
    }
    return {"state": _snapshot(model, opt), "stored": stored}


def uninterrupted(dtype: str | None) -> dict[str, Any]:
    model, opt = _model(False, dtype)
    _run(model, opt, range(SAVED))
    at_save = _snapshot(model, opt)
    _run(model, opt, range(SAVED, TOTAL))
    return {"at_save": at_save, "final": _snapshot(model, opt)}


def resume(root: str, dtype: str | None) -> dict[str, Any]:
    model, opt = _model(True, dtype, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt.load_checkpoint(root, model, opt)
    loaded = _snapshot(model, opt)
    _run(model, opt, range(SAVED, TOTAL))
    return {
        "warnings": [str(w.message) for w in caught if "momentum_dtype" in str(w.message)],
        "group_dtype": opt.param_groups[0]["momentum_dtype"],
        "loaded": loaded,
        "final": _snapshot(model, opt),
    }
