"""The split planning layer (``muon_dtensor/planning/split.py``) and ``predict(..., split=True)``.

Pure arithmetic, no processes. The plan decides which matrices run their Newton-Schulz over k
ranks; these tests pin that it splits only where the cost model says it pays, that a split matrix
occupies k aligned ranks of one node, that the loads account for every piece, and that the default
prediction (``split=False``) is the one the optimizer's plan gives.
"""

from __future__ import annotations

import pytest

from muon_dtensor.numerics.newton_schulz import ns_flops
from muon_dtensor.numerics.split_ns import split_flops
from muon_dtensor.planning.costmodel import LLAMA3_8B, LLAMA3_70B, LLAMA31_405B, Hardware, predict
from muon_dtensor.planning.split import (
    SplitPlan,
    _gang_balance,
    alltoall_seconds,
    plan_splits,
    split_links,
    split_seconds,
)
from muon_dtensor.sharding.plan.blocks import AxisShard, shard_blocks
from muon_dtensor.sharding.plan.build import MatrixEntry, build_plan

RANKS = [8, 16, 64, 128, 256, 512, 1024]


def test_split_seconds_price_the_steps_flops_and_exchanges() -> None:
    """The model prices the step's split (``split_ns.split_flops``: Gram and update by column
    blocks, ``A A`` by rows) and three Gram-sized exchanges per iteration, ragged blocks at the
    largest."""
    m, n = 8192, 28672
    assert split_flops((n, m), 1, steps=5) == ns_flops((m, n), 5)
    assert split_flops((m, n), 3, steps=1) == 4 * m * m * -(-n // 3) + 2 * m * m * -(-m // 3)
    hw = Hardware.h200()
    assert alltoall_seconds(1e9, 1, hw) == 0.0
    assert alltoall_seconds(1e9, 8, hw) == pytest.approx(
        hw.collective_latency + 0.875e9 / hw.intra_node_bandwidth
    )
    copies = 2 * m * (n // 4) * 2 * 2 / hw.memory_bandwidth
    exchanges = 15 * alltoall_seconds(m * m * 2, 4, hw) + 2 * alltoall_seconds(16, 4, hw)
    expected = split_flops((m, n), 4, steps=5) / hw.matmul_flops + exchanges + copies
    assert split_seconds((m, n), 4, hw) == pytest.approx(expected)
    assert split_seconds((m, n), 2, hw) < split_seconds((m, n), 1, hw)


def _check_plan(plan: SplitPlan, shapes: list[tuple[int, int]], n: int, node: int) -> None:
    assert len(plan.ks) == len(plan.ranks) == len(plan.seconds) == len(shapes) and len(plan.loads) == n
    for k, ranks in zip(plan.ks, plan.ranks):
        assert len(ranks) == k and k in (1, 2, 4, 8) and node % k == 0
        assert ranks == tuple(range(ranks[0], ranks[0] + k)) and ranks[0] % k == 0, "aligned, one node"
    work = sum(s * k for s, k in zip(plan.seconds, plan.ks))
    assert sum(plan.loads) >= work * (1 - 1e-12), "every piece is on some rank's load"
    busiest = [0.0] * n
    for seconds, ranks in zip(plan.seconds, plan.ranks):
        for r in ranks:
            busiest[r] += seconds
    assert all(load >= b * (1 - 1e-12) for load, b in zip(plan.loads, busiest))


@pytest.mark.parametrize("n", RANKS)
def test_splits_only_where_they_pay(n: int) -> None:
    for shapes in (LLAMA3_8B, LLAMA3_70B):
        split, whole = plan_splits(shapes, n), plan_splits(shapes, n, max_k=1)
        _check_plan(split, shapes, n, 8)
        assert whole.split_count == 0
        assert split.makespan <= whole.makespan
        if split.split_count:
            assert split.makespan < whole.makespan, "split only when the busiest rank gains"


def test_where_the_largest_matrix_bounds_the_step_it_is_split() -> None:
    for shapes, n in ((LLAMA3_8B, 1024), (LLAMA3_70B, 1024), (LLAMA31_405B, 1024)):
        split, whole = plan_splits(shapes, n), plan_splits(shapes, n, max_k=1)
        assert split.split_count > 0 and split.makespan < 0.7 * whole.makespan
        assert split.imbalance < whole.imbalance
    assert plan_splits(LLAMA3_8B, 8).split_count == 0, "8 ranks: the mean is far above any matrix"


def test_gangs_wait_for_their_busiest_rank() -> None:
    """Two 4-rank gangs and whole matrices on 8 ranks of one node: a gang starts when all its
    ranks are free, so the loads are the gang lockstep's, not each rank's own sum."""
    plan = plan_splits([(512, 4096)] * 2 + [(64, 64)] * 3, 8, Hardware.h200(matmul_flops=1e9))
    _check_plan(plan, [(512, 4096)] * 2 + [(64, 64)] * 3, 8, 8)
    assert plan.ks[:2] == (4, 4) and {plan.ranks[0], plan.ranks[1]} == {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_gang_balance_aligns_and_waits() -> None:
    """A gang of 4 after a long whole matrix on rank 0 takes ranks 4-7 (aligned, so one node's
    NVLink), not 1-4; a gang over two busy ranks starts when the busier is free."""
    ranks, loads = _gang_balance([10.0, 1.0], [1, 4], 8)
    assert ranks == [(0,), (4, 5, 6, 7)] and loads == [10.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    ranks, loads = _gang_balance([2.0, 1.0, 1.0], [1, 2, 1], 2)
    assert ranks == [(0,), (0, 1), (0,)] and loads == [4.0, 3.0]


def test_the_plan_is_no_worse_than_any_cap_on_k() -> None:
    """Every cap on k is tried and the best refined shape by shape, so the plan is at most the best
    capped plan's makespan; on 70B at 1,024 ranks the refinement finds a shorter one."""
    for shapes, n in ((LLAMA3_8B, 512), (LLAMA3_8B, 1024), (LLAMA3_70B, 1024)):
        best = plan_splits(shapes, n).makespan
        capped = [plan_splits(shapes, n, max_k=c).makespan for c in (1, 2, 4, 8)]
        assert best <= min(capped) * (1 + 1e-12)
    assert plan_splits(LLAMA3_70B, 1024).makespan < 0.99 * plan_splits(LLAMA3_70B, 1024, max_k=1).makespan


def test_no_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan_splits(LLAMA3_8B, 0)


def test_split_traffic_spreads_a_matrix_over_its_ranks() -> None:
    """64 x 64 in bf16 on 8 ranks (8 rows each, 1,024 bytes), split over ranks 0-3: each source
    sends 256 bytes to each of them; each sends 256 bytes of every other rank's block back."""
    entry = MatrixEntry((64, 64), shard_blocks((64, 64), [AxisShard(0, 0, 8)]))
    plan = build_plan([entry], 8)
    split = SplitPlan(8, (4,), ((0, 1, 2, 3),), (1.0,), (1.0,) * 4 + (0.0,) * 4)
    into, back = split_links(plan, [0], split, 2, [0] * 8)
    assert into.send_intra == [768.0] * 4 + [1024.0] * 4
    assert into.recv_intra == [1792.0] * 4 + [0.0] * 4
    assert back.send_intra == [1792.0] * 4 + [0.0] * 4
    assert sum(into.send_intra) == sum(back.send_intra) == 7168.0


@pytest.mark.slow
def test_default_prediction_is_unchanged_and_split_never_slower() -> None:
    for n in (8, 64, 256, 1024):
        base = predict(LLAMA3_8B, n)
        assert predict(LLAMA3_8B, n, split=False) == base
        assert predict(LLAMA3_8B, n, split=True).total <= base.total
    # Splits pay at 256+ and the step keeps falling with ranks; the host's eager ops (counted from
    # the routes, planning/host_ops.py) grow with shapes, not matrices, so they do not bound it.
    steps = [predict(LLAMA3_8B, n, split=True) for n in (128, 256, 512, 1024)]
    totals = [p.total for p in steps]
    assert totals == sorted(totals, reverse=True) and totals[-1] < 0.6 * predict(LLAMA3_8B, 1024).total
    assert steps[-1].host < steps[-1].total


@pytest.mark.slow
def test_split_shortens_the_70b_step_at_1024() -> None:
    """Also the planning CLI's figure (``--ns-split``, test_planning_cli): under 0.6 of the step."""
    base, split = predict(LLAMA3_70B, 1024), predict(LLAMA3_70B, 1024, split=True)
    assert split.total < 0.6 * base.total and split.newton_schulz < base.newton_schulz
    assert split.imbalance < base.imbalance and split.comm < base.comm


def test_plans_are_cached_and_equal_the_search() -> None:
    """``plan_splits`` runs its search once per setting (the tests, ``predict(split=True)`` and the
    optimizer's ``ns_split="auto"`` ask again): a repeat is the same frozen plan, equal to a fresh
    search; other arguments are other entries."""
    from muon_dtensor.planning.split import _plan_splits

    shapes = [(512, 4096)] * 2 + [(64, 64)] * 3
    hw = Hardware.h200(matmul_flops=1e9)
    first = plan_splits(shapes, 8, hw)
    assert plan_splits([list(s) for s in shapes], 8, hw) is first  # type: ignore[misc]
    assert _plan_splits(tuple(shapes), 8, hw, 5, 2, "standard", None, 2) == first
    assert (
        plan_splits(shapes, 8, hw, max_k=1) != first and plan_splits(shapes, 8, hw, max_k=1).split_count == 0
    )


def test_split_links_counts_per_node_as_the_pairwise_loop_does() -> None:
    """``_spread`` (O(ranks) per matrix) against every (source, split rank) pair added one by one."""
    import random

    from muon_dtensor.planning.links import Links
    from muon_dtensor.planning.split import _spread

    rng = random.Random(0)
    n = 24
    nodes = [r // 8 for r in range(n)]
    for replicated in (False, True):
        sizes = [float(rng.randrange(0, 50)) for _ in range(n)]
        group = rng.sample(range(n), 5)
        fast = (Links.empty(n), Links.empty(n))
        _spread(*fast, sizes, group, nodes, replicated)
        slow = (Links.empty(n), Links.empty(n))
        for r, nbytes in enumerate(sizes):
            for g in group:
                if g != r:
                    if not replicated:
                        slow[0].add(r, g, nbytes, nodes)
                    slow[1].add(g, r, nbytes, nodes)
        assert fast == slow, replicated


def test_gang_balance_picks_what_a_scan_of_every_block_picks() -> None:
    """The heaps of aligned blocks against the plain rule: the least-loaded rank for one rank, and
    ``min(starts, key=(largest load in the block, start))`` for a gang of k."""
    import random

    def scanned(seconds: list[float], ks: list[int], n: int) -> tuple[list[tuple[int, ...]], list[float]]:
        loads = [0.0] * n
        ranks: list[tuple[int, ...]] = [()] * len(seconds)
        for i in sorted(range(len(seconds)), key=lambda j: (-seconds[j] * ks[j], j)):
            k = ks[i]
            if k == 1:
                group: tuple[int, ...] = (min(range(n), key=lambda r: (loads[r], r)),)
            else:
                start = min(range(0, n - k + 1, k), key=lambda s: (max(loads[s : s + k]), s))
                group = tuple(range(start, start + k))
            begin = max(loads[r] for r in group)
            for r in group:
                loads[r] = begin + seconds[i]
            ranks[i] = group
        return ranks, loads

    rng = random.Random(1)
    for _ in range(50):
        n = rng.choice([8, 16, 24])
        seconds = [float(rng.randrange(1, 20)) for _ in range(rng.randrange(1, 40))]
        ks = [rng.choice([1, 1, 2, 4, 8]) for _ in seconds]
        assert _gang_balance(seconds, ks, n) == scanned(seconds, ks, n)
