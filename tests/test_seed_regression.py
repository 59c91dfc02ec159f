"""The bug this package exists for.

KellerJordan/Muon's distributed optimizer gives parameter i to rank i % world: that rank alone
updates it and alone keeps its momentum buffer, then broadcasts the parameter. Nothing ever syncs
the momentum. A user saves ``optimizer.state_dict()`` from rank 0, as with any other optimizer, and
the checkpoint holds 1 of every ``world`` momentum buffers; on resume the others restart from zero
and the run silently leaves the uninterrupted trajectory (the thread is in shared/seeds/). With
muon_dtensor the momentum buffers are DTensors shaped like their parameters, DCP writes every
rank's shard, and the resumed run is the uninterrupted run, bit for bit.
"""

from __future__ import annotations

from tests.distributed import run_ranks
from tests.workers_seed import muon_dtensor_resume, round_robin_resume


def test_round_robin_loses_momentum_and_muon_dtensor_keeps_it(tmp_path) -> None:
    theirs = run_ranks(round_robin_resume, 4, str(tmp_path))[0]
    assert theirs["buffers_kept"] == theirs["buffers"] // 4  # 2 of 8: only rank 0's matrices
    assert theirs["gap"] > 1e-3  # the resumed run diverges from the uninterrupted one
    ours = run_ranks(muon_dtensor_resume, 4, str(tmp_path / "ours"))[0]
    assert ours["buffers_kept"] == ours["buffers"]
    assert ours["gap"] == 0.0
