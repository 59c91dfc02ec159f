"""``run_ranks``'s launcher (``muon_dtensor/testing/launcher.py``): on Linux without GPUs the ranks are
forked from one process that imported torch once, which the calling process keeps for its next
launch in the same environment. Each rank is still a process of its own, a rank that hangs dies
with its launcher at the deadline, and the other way (one interpreter per rank, as on a GPU host)
gives the same results."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

from muon_dtensor.testing import RankError, run_ranks
from muon_dtensor.testing import runner as testing
from tests.harness import background
from tests.harness.ranks import process_state


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


@pytest.mark.slow  # an interpreter per rank: torch imported twice more
def test_one_interpreter_per_rank_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "FORK", False)
    ranks = run_ranks(who, 2)
    assert [r[0] for r in ranks] == [0, 1]
    assert ranks[0][2] == ranks[1][2] == os.getpid()  # each rank started by this process


def test_a_hanging_rank_dies_with_its_launcher(tmp_path: Path) -> None:
    run_ranks(who, 2)  # the launcher this process keeps has imported torch: the deadline is the ranks'
    # forked ranks of a launcher that is up meet in well under a second (the pool's hang test: 2 s too)
    with pytest.raises(RankError, match="rank 1 timed out after 2 s"):
        run_ranks(hang_on_rank_1, 2, str(tmp_path), timeout=2)
    pid = int((tmp_path / "pid1").read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and process_state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or process_state(pid) == "Z", (
        "the hanging rank outlived the call"
    )


@pytest.mark.slow  # two more launchers (another environment, another thread): torch imported again
@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_the_launcher_serves_the_next_launch_and_another_environment_gets_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    first, again = run_ranks(who, 2), run_ranks(who, 2)  # after a launcher was killed (the test above)
    assert first[0][2] == again[0][2] and first[0][1] != again[0][1]  # one launcher, new ranks
    monkeypatch.chdir(tmp_path)
    moved = run_ranks(who, 2)
    assert moved[0][2] == first[0][2] and {r[4] for r in moved} == {str(tmp_path)}  # where the caller is now
    # torch sets the inductor cache folder when it first needs it: the same launcher, the new value
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cached = run_ranks(launcher_and_variable, 2, "TORCHINDUCTOR_CACHE_DIR")
    assert cached == [(first[0][2], str(tmp_path / "inductor"))] * 2
    monkeypatch.setenv("MUON_DTENSOR_LAUNCHER_TEST", "1")
    with ThreadPoolExecutor(1) as pool:  # another thread, at the same time: a launcher for it only
        in_thread = pool.submit(run_ranks, who, 2)
        other = run_ranks(who, 2)
        threaded = in_thread.result()
    assert other[0][2] != first[0][2]  # imported torch under another environment: not reused
    assert threaded[0][2] not in (first[0][2], other[0][2]) and [r[0] for r in threaded] == [0, 1]


def launcher_and_variable(name: str) -> tuple[int, str | None]:
    return os.getppid(), os.environ.get(name)


def stdin_of_rank() -> tuple[str, str]:
    """What this rank's stdin is, and what reading it to the end gives."""
    return os.readlink("/proc/self/fd/0"), sys.stdin.read()


def file_mode(folder: str) -> int:
    path = Path(folder, f"made{dist.get_rank()}")
    path.write_text("x")
    return path.stat().st_mode & 0o777


@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_a_ranks_stdin_is_dev_null() -> None:
    run_ranks(who, 2)  # a kept launcher, whose request pipe a rank must not read
    assert run_ranks(stdin_of_rank, 2, timeout=30) == [("/dev/null", "")] * 2


def test_a_rank_runs_its_function_only_after_every_rank_has_joined(tmp_path: Path) -> None:
    """A rank whose function does not communicate must not leave while a peer's gloo is still
    connecting to it (CI, stop 53: "Connection closed by peer" in a slower rank's init): joining
    ends with a collective over every rank, which no rank finishes before all have connected."""
    from types import SimpleNamespace

    from muon_dtensor.testing.rank import join

    calls: list[tuple[str, object]] = []
    fake = SimpleNamespace(
        init_process_group=lambda backend, **kw: calls.append(("init", (kw["rank"], kw["world_size"]))),
        all_reduce=lambda tensor, **kw: calls.append(("all_reduce", (tensor.device.type, kw.get("group")))),
    )
    join(fake, 1, 2, str(tmp_path))  # type: ignore[arg-type]
    assert calls == [("init", (1, 2)), ("all_reduce", ("cpu", None))]  # the world's group, on the host


@pytest.mark.slow  # a fresh launcher: torch imported again (the fast loop keeps the served launch)
@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_a_changed_umask_gets_a_fresh_launcher(tmp_path: Path) -> None:
    first = run_ranks(who, 2)
    old = os.umask(0o077)
    try:
        assert run_ranks(file_mode, 2, str(tmp_path)) == [0o600, 0o600]  # the caller's umask, not 0o644
        assert run_ranks(who, 2)[0][2] != first[0][2]
    finally:
        os.umask(old)
    assert run_ranks(who, 2)[0][2] == first[0][2]  # the launcher of the first umask is kept


# A caller whose copy of muon_dtensor changes between two launches (an edit, another checkout on
# the same path): the second launch's ranks must run the changed file, not the launcher's import.
# The edit keeps the file's size and its modification time's second (issue 49 item 7: the check
# once missed an edit, 1 run in 3): Python trusts a .pyc whose recorded size and whole-second
# mtime match, so a fresh launcher ran the old code until the changed file's bytecode was removed.
EDITED_CALLER = """
import os, sys
from muon_dtensor.testing import run_ranks

def edited():
    import muon_dtensor.optim.optimizer as o
    return getattr(o, "EDITED_FOR_THE_TEST", None)

if __name__ == "__main__":
    first = run_ranks(edited, 2)
    path = sys.argv[1]
    before = os.stat(path).st_mtime_ns
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("EDITED_FOR_THE_TEST = 0", "EDITED_FOR_THE_TEST = 1"))
    same_second = before + 1 if (before + 1) % 10**9 else before - 1
    os.utime(path, ns=(same_second, same_second))
    print(first, run_ranks(edited, 2))
"""


@background.job("changed_library_file")
def _changed_library_file(folder: Path) -> subprocess.CompletedProcess[str]:
    """A caller of a copy of muon_dtensor, edited between its two launches (three interpreters that
    import torch, one after another: a background job, tests/harness/background.py)."""
    import shutil

    import muon_dtensor

    copy = folder / "muon_dtensor"
    shutil.copytree(Path(muon_dtensor.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "optim" / "optimizer.py"
    with open(target, "a") as f:
        f.write("\nEDITED_FOR_THE_TEST = 0\n")
    (folder / "caller.py").write_text(EDITED_CALLER)
    # bytecode written, as by default (a session may run with PYTHONDONTWRITEBYTECODE set)
    env = background.environ(PYTHONPATH=str(folder))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return background.run(
        [sys.executable, str(folder / "caller.py"), str(target)], timeout=300, env=env, cwd=folder
    )


changed_library_file = background.reader("changed_library_file")


@pytest.mark.slow  # a fresh launcher: torch imported again
@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_a_changed_library_file_gets_a_fresh_launcher(
    changed_library_file: subprocess.CompletedProcess,
) -> None:
    out = changed_library_file
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0,", "0]", "[1,", "1]"], out.stdout


def test_a_same_size_edit_within_the_second_loses_its_bytecode(tmp_path: Path) -> None:
    """The hazard itself, without a launcher: a fresh interpreter runs the stale .pyc of a same-size
    edit within the same second, until ``forget_bytecode`` removes it."""
    import py_compile

    from muon_dtensor.testing.launcher import forget_bytecode, sources

    module = tmp_path / "edited_module.py"
    module.write_text("X = 1\n")
    second = (int(module.stat().st_mtime) - 10) * 10**9
    os.utime(module, ns=(second + 100, second + 100))
    py_compile.compile(str(module))
    seen = sources(tmp_path)
    module.write_text("X = 2\n")
    os.utime(module, ns=(second + 200, second + 200))
    assert sources(tmp_path) != seen  # what the launcher compares: the change is visible
    read = [sys.executable, "-c", "import edited_module; print(edited_module.X)"]

    def value() -> str:
        return subprocess.run(read, cwd=tmp_path, capture_output=True, text=True, timeout=60).stdout.strip()

    assert value() == "1"  # Python's own check passed the stale bytecode
    forget_bytecode([str(module)])
    assert value() == "2"


# A caller interrupted by Ctrl-C during a launch: the terminal sends SIGINT to its foreground process
# group (``group``), a notebook's interrupt to the caller alone. Either way the ranks end, and nothing
# but the caller's own output reaches its stderr.
INTERRUPTED_CALLER = """
import os, signal, sys, time
from pathlib import Path
# Ctrl-C raises KeyboardInterrupt here even where the session was started with SIGINT ignored (a
# background job of a non-interactive shell is: Python then leaves it ignored in every child)
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch.distributed as dist
from muon_dtensor.testing import run_ranks

def sleep(folder):
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(600)

def rank():
    return dist.get_rank()

def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

if __name__ == "__main__":
    run_ranks(rank, 2)  # the launcher is kept, warm
    try:
        run_ranks(sleep, 2, sys.argv[1], timeout=300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    # while this process lives on (as a notebook's kernel does), its ranks must be gone
    pids = [int(Path(sys.argv[1], f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    print("running" if any(alive(pid) for pid in pids) else "ended", flush=True)
    time.sleep(3)  # a launcher that died late would write its traceback meanwhile
"""


@background.job("interrupted_launches")
def _interrupted_launches(folder: Path) -> dict[str, tuple[str, str, bool]]:
    """Both interrupts at once, each in its own caller: the terminal's (the caller's process group)
    and a notebook's (the caller alone); per case the caller's output and whether a rank outlived it.
    Run one after the other they took 21 s of the suite, most of it two interpreters importing torch
    and the caller's closing wait: a background job (tests/harness/background.py)."""
    (folder / "caller.py").write_text(INTERRUPTED_CALLER)
    cases = {"terminal": folder / "terminal", "caller_only": folder / "caller_only"}
    procs = {}
    try:
        for case, where in cases.items():
            where.mkdir()
            procs[case] = background.popen(
                [sys.executable, str(folder / "caller.py"), str(where)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=background.environ(),
            )  # fmt: skip
        pids = {case: _wait_for_pids(where, procs[case]) for case, where in cases.items()}
        os.killpg(procs["terminal"].pid, signal.SIGINT)
        os.kill(procs["caller_only"].pid, signal.SIGINT)
        outcomes = {case: proc.communicate(timeout=60) for case, proc in procs.items()}
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return {case: (out, err, any(_alive(pid) for pid in pids[case])) for case, (out, err) in outcomes.items()}


interrupted_launches = background.reader("interrupted_launches")


@pytest.mark.slow  # a caller and a launcher per case, both cases side by side
@pytest.mark.skipif(sys.platform != "linux", reason="the ranks are forked on Linux only")
def test_an_interrupted_launch_ends_its_ranks_quietly(
    interrupted_launches: dict[str, tuple[str, str, bool]],
) -> None:
    for case, (out, err, outlived) in interrupted_launches.items():
        assert (out, err) == ("interrupted\nended\n", ""), (case, out, err)
        assert not outlived, f"{case}: an interrupted rank outlived its caller"


def _wait_for_pids(folder: Path, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            pids = [int((folder / f"pid{r}").read_text()) for r in range(2)]
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        return pids
    raise AssertionError(f"the ranks never started: {proc.communicate(timeout=10)}")


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and process_state(pid) not in ("Z", "gone")
