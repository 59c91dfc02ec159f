"""The pool of rank processes (tests/harness/ranks.py) keeps every multi-rank test able to fail.

A pooled worker outlives the call, so a rank that raised could leave the others waiting in a
collective, and a stuck pool would turn every later test into a timeout. These tests pin the rules:
a rank that raises, hangs or dies fails the call with RankError (the rank's traceback, or why it has
none) within the call's deadline, the pool is replaced, and the next call passes; and every task
starts from the same RNG state, so results do not depend on the order tests run in.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import ranks
from tests.harness.ranks import GRACE, RankError, process_state, run_ranks


@pytest.mark.slow
def test_a_raising_rank_fails_the_call_with_its_traceback_and_the_pool_is_replaced() -> None:
    before = run_ranks(pid, 2)
    start = time.monotonic()
    with pytest.raises(
        RankError, match=r"(?s)rank 1 failed \(others hung\):\nTraceback.*ValueError: rank 1 broke"
    ):
        run_ranks(raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < GRACE + 5  # rank 0, stuck in the barrier, was not waited for
    after = run_ranks(pid, 2)
    assert set(after).isdisjoint(before), "the failed pool was reused"


@pytest.mark.slow
def test_a_hang_is_killed_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 timed out after 2 s \(hang\?\)"):
        run_ranks(hang_on_rank_0, 2, timeout=2)
    assert time.monotonic() - start < 2 + 5
    assert run_ranks(pid, 2)  # a new pool


@pytest.mark.slow
def test_a_dying_rank_fails_the_call() -> None:
    with pytest.raises(RankError, match=r"rank 1 died without a result \(exit code 3\)"):
        run_ranks(exit_on_rank_1, 2, timeout=60)


def test_every_task_starts_from_the_same_rng_state() -> None:
    expected = torch.rand(3, generator=torch.Generator().manual_seed(0))
    first, second = run_ranks(draw, 1)[0], run_ranks(draw, 1)[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_a_waiting_call_wakes_when_its_results_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call sleeps until a worker writes a byte to the pool's ``done`` FIFO, not for a fixed
    period: with its periodic wake-up set to a minute, a quick task still returns at once (without
    the byte it would wake at the deadline, 60 s)."""
    run_ranks(pid, 2)  # the pool up
    monkeypatch.setattr(ranks, "WAKE", 60.0)
    start = time.monotonic()
    assert run_ranks(pid_and_group_sum, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_a_pool_sleeps_between_calls_and_wakes_for_the_next() -> None:
    """Between calls the pool's processes are stopped (state T), so no gloo loop thread of theirs
    polls while the session runs other tests; the next call continues them and gets the same ranks."""
    first = run_ranks(pid, 2)
    if 2 not in ranks._POOLS:  # retired after the call (earlier tests' groups): the next one is fresh
        first = run_ranks(pid, 2)
    deadline = time.monotonic() + 10  # a signal is delivered when the process is next scheduled
    while {process_state(p) for p in first} != {"T"} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {process_state(p) for p in first} == {"T"}, [(p, process_state(p)) for p in first]
    again = run_ranks(pid_and_group_sum, 2)
    assert [p for p, _ in again] == first  # the same pool, awake again
    assert [s for _, s in again] == [1.0, 1.0]


def test_a_pool_is_forked_by_the_sessions_zygote_and_another_environment_gets_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool's launcher is a fork of the session's zygote, which imported torch once, so a pool
    that starts again costs no import; a pool asked for under another environment gets an
    interpreter of its own, started by this process, and its workers see that environment. A
    variable torch sets when it first needs it (in ``launcher.VOLATILE``) is no other environment:
    the zygote forks that pool too, and its workers see the variable."""
    _retire(2)
    launcher = run_ranks(parent_and_variable, 2, "MUON_DTENSOR_POOL_TEST")[0][0]
    assert _parent(launcher) == ranks._ZYGOTE[0].proc.pid != os.getpid()
    _retire(2)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nonexistent/inductor_cache_of_the_test")
    lazily = run_ranks(parent_and_variable, 2, "TORCHINDUCTOR_CACHE_DIR")
    assert _parent(lazily[0][0]) == ranks._ZYGOTE[0].proc.pid
    assert [v for _, v in lazily] == ["/nonexistent/inductor_cache_of_the_test"] * 2
    _retire(2)
    monkeypatch.setenv("MUON_DTENSOR_POOL_TEST", "1")
    own = run_ranks(parent_and_variable, 2, "MUON_DTENSOR_POOL_TEST")
    assert _parent(own[0][0]) == os.getpid() and [v for _, v in own] == ["1", "1"]
    _retire(2)  # the next test's pool gets the session's environment


def test_a_zygote_started_early_gives_way_to_the_first_pools_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zygote starts with the session (conftest's pytest_configure), before any test changed
    the environment; if the first pool's differs all the same, a new zygote takes its place (an
    unused one is provisional) instead of that pool, and every later one, importing torch anew."""
    _retire(2)
    with ranks.zygote_aside():  # the session's zygote forks the background jobs' pools: not closed
        monkeypatch.setenv("MUON_DTENSOR_POOL_TEST", "early")
        ranks.start_zygote()
        early = ranks._ZYGOTE[0].proc.pid
        monkeypatch.delenv("MUON_DTENSOR_POOL_TEST")
        launcher, seen = run_ranks(parent_and_variable, 2, "MUON_DTENSOR_POOL_TEST")[0]
        assert _parent(launcher) == ranks._ZYGOTE[0].proc.pid != early and seen is None
        _retire(2)


def _retire(world_size: int) -> None:
    pool = ranks._POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def parent_and_variable(name: str) -> tuple[int, str | None]:
    """This worker's launcher, and what it sees of the environment variable ``name``."""
    return os.getppid(), os.environ.get(name)


def pid_and_group_sum() -> tuple[int, float]:
    """This worker's pid and the sum of one 1/world per rank over a fresh group (its sockets
    survive the pool's stop and continue)."""
    group = dist.new_group(list(range(dist.get_world_size())))
    value = torch.full((1,), 1.0 / dist.get_world_size())
    dist.all_reduce(value, group=group)
    return os.getpid(), float(value)


def pid() -> int:
    return os.getpid()


def raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 broke")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def hang_on_rank_0() -> None:
    if dist.get_rank() == 0:
        dist.barrier()


def exit_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def draw() -> torch.Tensor:
    out = torch.rand(3)
    torch.rand(100)  # moves the global RNG on: the next task must not start here
    return out
