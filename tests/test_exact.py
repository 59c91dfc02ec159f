"""A sharded step is the one-process step, bit for bit, on every layout, at world sizes 1, 2, 4."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.workers import exactness


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_step_equals_single_process(world_size: int) -> None:
    results = run_ranks(exactness, world_size, timeout=240)
    for rank, per_layout in enumerate(results):
        assert per_layout, "no layout was checked"
        for key, r in per_layout.items():
            assert r["params"] == [], f"rank {rank} {key}: parameters differ at {r['params']}"
            assert r["momentum"] == [], f"rank {rank} {key}: momentum differs at {r['momentum']}"
            assert r["state_like_param"], f"rank {rank} {key}: momentum is not laid out like its param"
    if world_size > 1:
        assert results[0]["fsdp/owner/bfloat16"]["sent"] > 0, "owner mode moved no data"
        # small rounds really split the exchange (2 all-to-alls per round and step)
        assert (
            results[0]["fsdp/rounds/bfloat16"]["collectives"]
            > results[0]["fsdp/owner/bfloat16"]["collectives"]
        )
