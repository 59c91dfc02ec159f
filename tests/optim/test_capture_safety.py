"""What a CUDA graph of a steady step needs, checked on CPU: every steady step issues the same ops
with the same output shapes and dtypes (so a captured step's allocations are the replayed step's),
with the learning rate changing between steps as a schedule changes it, and reads nothing from
the device (no ``.item()``, no branching on a tensor's value: ``tests/optim/test_host_sync.py``'s watch,
here on the one-process path too). What capture itself does is measured on a GPU by
``benchmarks/gpu_check.py`` part (d); docs/design.md ("Capturing a step") says what holds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from muon_dtensor import Muon, split_params
from muon_dtensor.sharding.plan.param_layout import local_of
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, distribute_like, model_grads
from tests.optim.test_host_sync import SyncWatch

Op = tuple[str, tuple[tuple[tuple[int, ...], torch.dtype], ...]]


class Allocations(TorchDispatchMode):
    """Every op below the optimizer, with the shapes and dtypes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = tuple((tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.ops.append((str(func), made))
        return out


def steady_steps(world: int) -> dict[str, Any]:
    """Two warm-up steps, then steps 2 and 3 recorded, lr changed before each; step 3 watched for
    host reads too."""
    model = build((world,) if world > 1 else None)
    opt = Muon(split_params(model), lr=0.02)
    grads = model_grads(model, 70)
    recorded = []
    for step in range(4):
        for p, g in zip(model.parameters(), grads(step)):
            p.grad = distribute_like(p, g)
        for group in opt.param_groups:
            group["lr"] = 0.02 * (1 - 0.1 * step)  # a schedule: another value every step
        if step < 2:
            opt.step()
            continue
        mode = Allocations()
        device = [local_of(t) for p in model.parameters() for t in (p, p.grad) if t is not None]
        device += [local_of(v) for p in model.parameters() for k, v in opt.state[p].items() if k != "step"]
        watch = SyncWatch(device)
        with mode, watch:
            opt.step()
        recorded.append((mode.ops, watch.found))
    (first, _), (second, found) = recorded
    return {"same": first == second, "ops": len(first), "found": found, "diff": _first_diff(first, second)}


def _first_diff(a: list[Op], b: list[Op]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x} then {y}"
    return "" if len(a) == len(b) else f"{len(a)} ops then {len(b)}"


@pytest.mark.parametrize("world", [1, 2])
def test_steady_steps_allocate_alike_and_read_nothing_back(world: int) -> None:
    results = [steady_steps(1)] if world == 1 else run_ranks(steady_steps, world, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["same"] and r["ops"] > 0, (rank, r["diff"])
        assert r["found"] == [], (rank, r["found"])
