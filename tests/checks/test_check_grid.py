"""The check's sum over many ranks runs as a butterfly of two-rank sums (``sharding/plan/grid.py``,
``runtime.groups.check_groups``): gloo's ring all-reduce takes 4 (P - 1) hops, so at 8,192 ranks one
sum is 32,764 hops (0.66 s at 20 us a hop, ``benchmarks/results/check_allreduce.json``), the
butterfly's 13 steps (a two-rank all-gather each, priced as measured beside the two-rank all-reduce:
0.79 of its 4 hops). The butterfly is forced on 3 and 4 gloo ranks here: the step is bitwise the
flat one's, and a rank that differs still raises on every rank.

Regression (issue 49): the grid before it created its lines with
``dist.new_group(members, use_local_synchronization=True)``, which torch names from the number of
groups this rank already holds. After one ordinary ``dist.new_group([0, 1])`` on every rank, or a
group a pipeline stage made for itself, the members of one line computed different names, met at
different store prefixes, and every rank waited until the process group's timeout. The pairs are
now named from their members alone (``groups._named``); these tests make such a group first.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_dtensor import Muon
from muon_dtensor.planning.hardware import (
    GLOO_HOP_SECONDS,
    GLOO_PAIR_STEP_SECONDS,
    Hardware,
    check_collectives,
    check_seconds,
)
from muon_dtensor.sharding.plan import grid
from muon_dtensor.sharding.runtime import groups
from tests.harness.ranks import run_apart, run_ranks

TIMEOUT = 90  # a rank that waits at another store prefix is a hang: fail at this deadline


def test_butterfly_steps() -> None:
    assert grid.butterfly_steps(256, 0) == []  # one all-reduce up to GRID_ABOVE
    assert len(grid.butterfly_steps(8192, 0)) == 13 and len(grid.butterfly_steps(1024, 5)) == 10
    assert grid.butterfly_steps(8192, 5)[0] == ((4, 5), False)  # bit 0 first
    assert grid.ring_hops(256) == 4 * 255 and grid.ring_hops(2) == 4
    assert len(grid.butterfly_steps(8191, 0)) == 12 + 2  # not a power of two: folded in and out, no ring
    assert grid.butterfly_steps(1000, 999) == [((487, 999), False), ((487, 999), True)]  # folded
    assert grid.butterfly_steps(1000, 487)[0] == grid.butterfly_steps(1000, 487)[-1] == ((487, 999), False)


@pytest.mark.parametrize("op", [sum, max])
def test_butterfly_gives_every_rank_the_total(op: Any) -> None:
    """The schedule, played out: a pair reduces when both its members reach it (each waits in its
    all-reduce for the other), bringing what they hold (a member that adds nothing brings zeros to a
    sum, its own value to a max). Nobody waits forever, and every rank ends with the total."""
    rng = random.Random(0)
    for size in [*range(3, 41), 96, 100, 257]:
        values = [rng.randrange(-1000, 1000) for _ in range(size)]
        held, at = list(values), [0] * size
        plans = [grid.butterfly_steps(size, i, above=2) for i in range(size)]
        while any(at[i] < len(plans[i]) for i in range(size)):
            ready = {
                plans[i][at[i]][0]
                for i in range(size)
                if at[i] < len(plans[i]) and all(at[j] < len(plans[j]) for j in plans[i][at[i]][0])
            }
            ready = {(a, b) for a, b in ready if plans[a][at[a]][0] == plans[b][at[b]][0] == (a, b)}
            assert ready, f"{size} ranks: every rank waits for another"
            for a, b in ready:
                brought = [0 if plans[i][at[i]][1] and op is sum else held[i] for i in (a, b)]
                held[a] = held[b] = op(brought)
                at[a], at[b] = at[a] + 1, at[b] + 1
        assert held == [op(values)] * size, size


def test_check_priced_per_backend() -> None:
    gloo, nccl = Hardware.h200(check_backend="gloo"), Hardware.h200()
    assert check_seconds(gloo, 8192) == pytest.approx(13 * GLOO_PAIR_STEP_SECONDS)
    assert check_seconds(gloo, 8191) == pytest.approx(14 * GLOO_PAIR_STEP_SECONDS)
    assert check_seconds(gloo, 256) == pytest.approx(4 * 255 * GLOO_HOP_SECONDS)  # linear up to the butterfly
    # a step as measured: less than the two-rank all-reduce it was timed beside (4 hops)
    assert GLOO_PAIR_STEP_SECONDS < 4 * GLOO_HOP_SECONDS
    assert check_seconds(nccl, 8192) == nccl.collective_latency
    assert check_collectives(gloo, 8192) == 13 and check_collectives(nccl, 8192) == 1


def _made_first(kind: str) -> None:
    """A group made before the check, so that ranks hold different numbers of groups."""
    rank = dist.get_rank()
    if kind == "subset":  # an ordinary new_group on every rank, of the first two ranks
        dist.new_group([0, 1])
    elif kind == "stage" and rank < 2:  # a pipeline stage's own group, made by its ranks alone
        dist.new_group([0, 1], use_local_synchronization=True)


def _steps(forced: bool, lr_of_rank_1: float = 0.02, made_first: str = "none") -> Any:
    above = grid.GRID_ABOVE
    if forced:
        grid.GRID_ABOVE = 1
    try:
        _made_first(made_first)
        world = dist.group.WORLD
        assert world is not None
        sizes = [dist.get_world_size(g) for g, _ in groups.check_groups(world)]
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        gen = torch.Generator().manual_seed(0)
        p: Any = nn.Parameter(distribute_tensor(torch.randn(12, 8, generator=gen), mesh, [Shard(0)]))
        opt = Muon([p], lr=lr_of_rank_1 if dist.get_rank() == 1 else 0.02)
        for _ in range(2):
            p.grad = distribute_tensor(torch.ones(12, 8), mesh, [Shard(0)])
            try:
                opt.step()
            except ValueError as e:
                return sizes, str(e)
        return sizes, p.full_tensor().flatten().tolist()
    finally:
        grid.GRID_ABOVE = above


def test_butterfly_sum_on_gloo_is_the_flat_sum() -> None:
    flat = run_ranks(_steps, 4, False, timeout=TIMEOUT)
    forced = run_ranks(_steps, 4, True, timeout=TIMEOUT)
    assert [s for s, _ in flat] == [[4]] * 4
    assert [s for s, _ in forced] == [[2, 2]] * 4  # two sums of 2 ranks each
    assert [r for _, r in forced] == [r for _, r in flat]  # bitwise the same step on every rank


def test_butterfly_sum_still_raises_on_every_rank() -> None:
    results = run_ranks(_steps, 4, True, 0.5, timeout=TIMEOUT)
    assert all(isinstance(r, str) and "'lr'" in r for _, r in results)


# the stage's case in the slow tier: the subset's holds the same naming
@pytest.mark.parametrize("made_first", ["subset", pytest.param("stage", marks=pytest.mark.slow)])
def test_a_group_made_first_neither_hangs_nor_changes_the_step(made_first: str) -> None:
    """On a pool of its own (``run_apart``): the group made first stays in its processes. One call
    runs the step, then a step whose lr differs on rank 1 over the same check groups."""
    flat = run_ranks(_steps, 4, False, timeout=TIMEOUT)
    both = run_apart(_step_then_a_differing_one, 4, made_first, timeout=TIMEOUT)
    assert [r for (_, r), _ in both] == [r for _, r in flat]
    assert all(isinstance(r, str) and "'lr'" in r for _, (_, r) in both)


def _step_then_a_differing_one(made_first: str) -> tuple[Any, Any]:
    return _steps(True, 0.02, made_first), _steps(True, 0.5)


@pytest.mark.slow  # a pool of its own; the fold itself is played out in the fast tier above
def test_three_ranks_fold_the_third_in_and_out() -> None:
    """3 ranks, not a power of two: rank 2 sums with rank 0 before and takes the total after."""
    flat = run_ranks(_steps, 3, False, timeout=TIMEOUT)
    forced = run_apart(_steps, 3, True, 0.02, "subset", timeout=TIMEOUT)
    assert [s for s, _ in forced] == [[2, 2, 2], [2], [2, 2]]
    assert [r for _, r in forced] == [r for _, r in flat]


def _stage_exchange() -> Any:
    """A stage's exchange group over two mesh axes, after rank 0 alone made one more group."""
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    dist.new_group([0, 2])  # ranks 0 and 2 now hold one group more than 1 and 3
    group = groups.exchange_group(mesh["dp", "tp"], (0, 1))
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t, group=group)
    return dist.get_process_group_ranks(group), float(t)


def test_a_stage_exchange_group_is_named_by_its_members() -> None:
    results = run_apart(_stage_exchange, 4, timeout=TIMEOUT)
    assert results == [([0, 1], 3.0), ([0, 1], 3.0), ([2, 3], 7.0), ([2, 3], 7.0)]


def test_the_steps_are_kept_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of a fake world of 1,024: the steps are worked out once per group (the P ranks read
    once, not on every sum of every step) and again only when ``GRID_ABOVE`` changes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=700, world_size=1024)
    try:
        world = dist.group.WORLD
        assert world is not None
        first = groups.check_groups(world)
        assert [sorted(dist.get_process_group_ranks(g)) for g, _ in first][:2] == [[700, 701], [700, 702]]
        reads: list[int] = []
        real = dist.get_process_group_ranks

        def counted(group: Any) -> list[int]:
            reads.append(1)
            return real(group)

        monkeypatch.setattr(dist, "get_process_group_ranks", counted)
        assert groups.check_groups(world) is first and not reads
        monkeypatch.setattr(grid, "GRID_ABOVE", 1024)
        assert groups.check_groups(world) == [(world, False)] and reads == [1]
    finally:
        dist.destroy_process_group()
