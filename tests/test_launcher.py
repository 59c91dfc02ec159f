"""``run_ranks``'s launcher (``muon_dtensor/tools/launcher.py``): on Linux without GPUs the ranks are
forked from one process that imported torch once, which the calling process keeps for its next
launch in the same environment. Each rank is still a process of its own, a rank that hangs dies
with its launcher at the deadline, and the other way (one interpreter per rank, as on a GPU host)
gives the same results."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from muon_dtensor.tools import testing
from muon_dtensor.tools.testing import RankError, run_ranks


def who() -> tuple[int, int, int, bool, str]:
    """(rank, pid, parent pid, torch imported before this function's module ran, working folder)."""
    return (
        dist.get_rank(),
        os.getpid(),
        os.getppid(),
        "torch.distributed.checkpoint" in sys.modules,
        os.getcwd(),
    )


def hang_on_rank_1(folder: str) -> None:
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(600)


@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_ranks_are_forked_from_one_launcher_that_imported_torch() -> None:
    ranks = run_ranks(who, 3)
    assert [r[0] for r in ranks] == [0, 1, 2]
    assert len({r[1] for r in ranks}) == 3  # three processes
    assert len({r[2] for r in ranks}) == 1 and ranks[0][2] != os.getpid()  # one launcher, not pytest
    assert all(r[3] for r in ranks)


def test_one_interpreter_per_rank_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "_forks", lambda env: False)
    ranks = run_ranks(who, 2)
    assert [r[0] for r in ranks] == [0, 1]
    assert ranks[0][2] == ranks[1][2] == os.getpid()  # each rank started by this process


def test_a_hanging_rank_dies_with_its_launcher(tmp_path: Path) -> None:
    run_ranks(who, 2)  # the launcher this process keeps has imported torch: the deadline is the ranks'
    with pytest.raises(RankError, match="rank 1 timed out after 5 s"):
        run_ranks(hang_on_rank_1, 2, str(tmp_path), timeout=5)
    pid = int((tmp_path / "pid1").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", "the hanging rank outlived the call"


@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_the_launcher_serves_the_next_launch_and_another_environment_gets_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, again = run_ranks(who, 2), run_ranks(who, 2)  # after a launcher was killed (the test above)
    assert first[0][2] == again[0][2] and first[0][1] != again[0][1]  # one launcher, new ranks
    monkeypatch.chdir(tmp_path)
    moved = run_ranks(who, 2)
    assert moved[0][2] == first[0][2] and {r[4] for r in moved} == {str(tmp_path)}  # where the caller is now
    monkeypatch.setenv("MUON_DTENSOR_LAUNCHER_TEST", "1")
    other = run_ranks(who, 2)
    assert other[0][2] != first[0][2]  # imported torch under another environment: not reused
    with ThreadPoolExecutor(1) as pool:  # another thread: a launcher for that launch only
        threaded = pool.submit(run_ranks, who, 2).result()
    assert threaded[0][2] not in (first[0][2], other[0][2]) and [r[0] for r in threaded] == [0, 1]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
