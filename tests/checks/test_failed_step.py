"""After a step fails inside its data path on one rank, the job cannot step half-way.

Before: a job that caught the failure and stepped again returned normally on one rank while the other
raised (3 of 3 runs): the first rank's collectives had paired with the other's unrelated ones, left
over from the failed step. An emergency ``save_checkpoint`` then hung in its first agreement. Now
every later step and checkpoint call raises at once on every rank, with the original failure and
the fix, until the process group is re-created; nothing is written.

Fresh processes (the launcher's, not the pool): the failure stays recorded for the rest of the job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from muon_dtensor.numerics.newton_schulz import NSConfig, orthogonalize
from muon_dtensor.testing import run_ranks

BOUND_S = 10.0
_FAIL = {"now": False}


def _failing(matrices: Sequence[Tensor], config: NSConfig) -> list[Tensor]:
    if _FAIL["now"] and matrices:
        raise RuntimeError(f"injected on rank {dist.get_rank()}")
    return orthogonalize(matrices, config)


def _grads(params: list[Any], seed: int) -> None:
    """Gradients laid out like their parameters, made locally (no collective: after the failure the
    test must not pair collectives of its own with the step's leftovers)."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        full = torch.randn(p.shape, generator=gen)
        local = full.chunk(dist.get_world_size())[dist.get_rank()]
        p.grad = DTensor.from_local(local, p.device_mesh, [Shard(0)], shape=p.shape, stride=p.stride())


def _attempt(call: Any) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        return "no error", "", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e), time.monotonic() - start


def fail_then_go_on(folder: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    params: list[Any] = [
        nn.Parameter(distribute_tensor(torch.randn(2 * world, 8, generator=gen), mesh, [Shard(0)]))
        for _ in range(2 * world)  # every rank owns some matrices
    ]
    module = nn.ParameterList(params)
    opt = Muon(params, lr=0.02, orthogonalize_fn=_failing)
    _grads(params, 1)
    opt.step()  # healthy
    _FAIL["now"] = rank == 0
    _grads(params, 2)
    first = _attempt(opt.step)
    _FAIL["now"] = False
    before = [p.to_local().clone() for p in params]
    _grads(params, 3)
    again = _attempt(opt.step)
    save = _attempt(lambda: ckpt.save_checkpoint(Path(folder) / "ckpt", 3, module, opt))
    load = _attempt(lambda: ckpt.load_checkpoint(Path(folder) / "ckpt", module, opt))
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(params, before))
    return {"first": first, "again": again, "save": save, "load": load, "unchanged": unchanged}


def test_every_later_step_and_checkpoint_call_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(fail_then_go_on, 2, str(tmp_path), timeout=120)
    assert [r["first"][0] for r in results] == ["RuntimeError", "RuntimeError"], results
    assert "injected on rank 0" in results[0]["first"][1]
    for call in ("again", "save", "load"):
        kinds = {r[call][0] for r in results}
        assert kinds == {"RuntimeError"}, (call, [r[call] for r in results])
        for rank, r in enumerate(results):
            kind, message, seconds = r[call]
            assert "refused, since an earlier Muon.step failed inside its data path" in message, (
                rank,
                message,
            )
            assert "injected on rank 0" in message, (rank, message)
            assert "Re-create the process group" in message, message
            assert seconds < BOUND_S, (call, rank, seconds)
    assert all(r["unchanged"] for r in results), "a refused step changed a weight"
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "the save wrote files"
