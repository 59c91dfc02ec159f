"""accelerate and HF Trainer with FSDP2 build the optimizer on plain parameters, then swap
``param_group["params"]`` in place for the DTensors ``fully_shard`` made (accelerate's
``fsdp2_switch_optimizer_parameters``). The optimizer must follow: its layouts and plans are
re-derived, and each old parameter's state moves to its successor, laid out like it.

Here the swap comes after a step on the plain parameters, so the moved momentum is not zero: the
run must still equal one process stepping the same gradients, bit for bit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, fsdp, full, model_grads, step_together

fsdp_utils = pytest.importorskip("accelerate.utils.fsdp_utils")
pytestmark = pytest.mark.integration


def switched_like_accelerate(steps: int = 4) -> dict[str, Any]:
    model = build(None)
    ref = copy.deepcopy(model)
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    grads = model_grads(ref, 300)
    step_together([(list(model.parameters()), opt), (list(ref.parameters()), ref_opt)], grads, range(1))
    old = dict(model.named_parameters())
    fsdp(model, (dist.get_world_size(),))
    new = dict(model.named_parameters())
    fsdp_utils.fsdp2_switch_optimizer_parameters(opt, {old[n].data_ptr: new[n] for n in old})
    step_together(
        [(list(model.parameters()), opt), (list(ref.parameters()), ref_opt)], grads, range(1, steps)
    )
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(full(p.detach()), q.detach()):
            bad.append(name)
        for key, value in opt.state[p].items():
            if not torch.equal(full(value), ref_opt.state[q][key]):
                bad.append(f"{name}:{key}")
            if value.ndim and not (
                isinstance(value, DTensor) and value.placements == getattr(p, "placements", None)
            ):
                bad.append(f"{name}:{key} not laid out like its parameter")
    saved = opt.state_dict()["state"]
    return {"bad": bad, "state_entries": len(opt.state), "params": len(new), "saved": len(saved)}


def test_accelerate_switch_steps_like_one_process() -> None:
    for rank, r in enumerate(run_ranks(switched_like_accelerate, 2, timeout=120)):
        assert r["bad"] == [], f"rank {rank}: {r['bad']}"
        assert r["state_entries"] == r["params"] == r["saved"], r  # no state left on old parameters
