"""A rank that raises inside a step and stays alive releases its peers: they raise within a bounded
time instead of waiting in the step's collectives for the process group's timeout.

Rank 1's ``orthogonalize_fn`` raises in the second step, while the other ranks wait for its
blocks in the exchange; rank 1 catches its error and stays alive until every peer has
reported (or a deadline), as a rank whose training loop logs an error and lingers would.

The failure is recorded in the job's store for the rest of the job. On 3 ranks the check runs on the
session's pool (tests/harness/ranks.py), which retires a pool after such a failure: the 3-rank pool that
test_one_rank_differs started is reused, not started again. On 4 ranks it runs in fresh processes
(the launcher's, ``muon_dtensor.testing.run_ranks``, tested here too): retiring the 4-rank
pool would only make the next 4-rank test start another.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_dtensor import Muon, testing
from muon_dtensor.numerics.newton_schulz import NSConfig, orthogonalize
from tests.harness import ranks
from tests.helpers.models import dt

BOUND_S = 20.0  # what the peers may take; they raise about one polling interval after the failure
LINGER_S = 60.0  # how long the raising rank stays alive waiting for its peers' reports
_FAIL = {"now": False, "calls": 0}


class Injected(RuntimeError):
    """The failure of one rank's orthogonalizer."""


def _failing(matrices: Sequence[Tensor], config: NSConfig) -> list[Tensor]:
    if _FAIL["now"] and matrices:
        _FAIL["calls"] += 1
        raise Injected(f"injected on rank {dist.get_rank()}")
    return orthogonalize(matrices, config)


def _step(opt: Muon, params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), dt(p).device_mesh, [Shard(0)])
    opt.step()


def one_rank_raises(folder: str, failing_rank: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    _FAIL.update(now=False, calls=0)  # a pooled worker may have run this before
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    params = [
        nn.Parameter(distribute_tensor(torch.randn(2 * world, 8, generator=gen), mesh, [Shard(0)]))
        for _ in range(2 * world)  # every rank owns some matrices
    ]
    opt = Muon(params, lr=0.02, orthogonalize_fn=_failing)
    _step(opt, params, 1)  # a healthy step: groups and plans exist
    _FAIL["now"] = rank == failing_rank
    start = time.monotonic()
    try:
        _step(opt, params, 2)
        outcome: dict[str, Any] = {"error": None}
    except BaseException as e:  # noqa: BLE001 - every rank records what it raised, and when
        outcome = {"error": type(e).__name__, "message": str(e)[:400]}
    outcome.update(seconds=time.monotonic() - start, calls=_FAIL["calls"])
    Path(folder, f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == failing_rank:  # alive, its process groups intact, until the peers have reported
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline and len(list(Path(folder).glob("rank*.json"))) < world:
            time.sleep(0.05)
    return outcome


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_peers_of_a_raising_rank_raise_in_bounded_time(tmp_path: Path, world: int) -> None:
    started = time.monotonic()
    run_ranks = ranks.run_ranks if world == 3 else testing.run_ranks
    outcomes = run_ranks(one_rank_raises, world, str(tmp_path), 1, timeout=LINGER_S + 60)
    assert outcomes[1]["error"] == "Injected" and outcomes[1]["calls"] == 1, outcomes[1]
    for rank, outcome in enumerate(outcomes):
        if rank == 1:
            continue
        assert outcome["error"] == "RuntimeError", (rank, outcome)
        assert "rank 1" in outcome["message"] and "Injected: injected on rank 1" in outcome["message"], (
            outcome
        )
        assert "restart from the last complete checkpoint" in outcome["message"], outcome
        assert outcome["seconds"] < BOUND_S, (rank, outcome)
    assert time.monotonic() - started < LINGER_S + 60
