"""Runs that tests read, started in the background of the session: the demo runs, the examples'
launches, the GPU check's dry run, distributed calls on pools of their own (``apart``). Each is a
subprocess (or a few) or a pool that mostly waits or runs on one core, while most of the session's
own tests run on one core too: started at the end of collection, they fill the other core instead
of adding their time to the session's.

A module registers one with ``@job("name")`` (a function of an empty folder, returning what its
tests read); a fixture of the same name returns ``result("name")``. conftest.py starts the jobs whose
fixture a selected test uses, one after another in the order of their first reader, and moves their
readers to the end of the session. A reader runs a job the background thread has not started
itself, so the session and that thread share the jobs left (``result``). A job that raises raises
in each of its readers. Subprocesses a job starts go through ``popen`` (their own session), so that
an interrupted session kills them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = [
    "JOBS", "Runner", "apart", "command", "environ", "folder", "importable", "job", "popen", "reader", "result",
    "run",
]  # fmt: skip

F = TypeVar("F", bound=Callable[[Path], Any])
JOBS: dict[str, Callable[[Path], Any]] = {}
TIMES: list[tuple[str, float, float]] = []  # each job's start and end, seconds after the first start
# The environment at the session's start: a job runs beside tests that may change os.environ for a
# while (monkeypatch.setenv), so it builds its subprocesses' environment from this one (``environ``).
_ENVIRON = dict(os.environ)
# The folder at the session's start, for the same reason: a test may chdir for a while
# (monkeypatch.chdir), and a job started meanwhile would otherwise run there (two jobs' ``python -c``
# once failed with "No module named 'tests'", started while a launcher test had moved).
_CWD = os.getcwd()
_ROOT = Path(__file__).resolve().parents[2]


def environ(**extra: str) -> dict[str, str]:
    """The session's starting environment with ``extra``, for a job's subprocess."""
    return {**_ENVIRON, **extra}


def importable(**extra: str) -> dict[str, str]:
    """``environ(**extra)`` with this checkout first on PYTHONPATH: a job's fresh interpreter, from
    any folder, imports this checkout's muon_dtensor and tests."""
    env = environ(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    return env


def job(name: str) -> Callable[[F], F]:
    """Register ``fn(folder)`` as the background job ``name``."""

    def register(fn: F) -> F:
        if JOBS.get(name, fn) is not fn:
            raise ValueError(f"two background jobs are named {name!r}")
        JOBS[name] = fn
        return fn

    return register


def run(argv: list[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, **kwargs)`` through ``popen``; past
    ``timeout`` seconds the run is killed (its return code then -9) instead of raising."""
    proc = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def command(name: str, argv: list[str], *, timeout: float, **kwargs: Any) -> Any:
    """Register the job ``name`` that is ``run(argv, timeout=timeout, **kwargs)`` (``env`` should
    come from ``environ``) and return its fixture, also named ``name``: assign it in the module."""
    job(name)(lambda folder: run(argv, timeout=timeout, **kwargs))
    return reader(name)


def apart(
    name: str, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float, in_folder: bool = False
) -> Any:
    """Register the job ``name`` that is ``tests.harness.ranks.run_apart(fn, world_size, *args)``
    (with the job's own folder, a str, as the first argument if ``in_folder``) and return its
    fixture, also named ``name``: a distributed test's call whose ranks run beside the session's
    tests, on a pool the zygote forks (no torch import). Worth it where the session's own chain of
    tests is the longer one, or runs alone on one core (the fast tier's in-process tests)."""

    def run_on_a_pool(folder: Path) -> Any:
        from tests.harness.ranks import run_apart

        first = (str(folder),) if in_folder else ()
        return run_apart(fn, world_size, *first, *args, timeout=timeout)

    job(name)(run_on_a_pool)
    return reader(name)


def reader(name: str) -> Any:
    """The fixture ``name`` that returns job ``name``'s result: assign it in the module under that
    name (a test that asks for it is moved to the session's end, and the job started)."""
    return pytest.fixture(name=name)(lambda: result(name))


def popen(command: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a session of its own, killed (with its children) if the session ends
    first; in the session's starting folder unless ``cwd`` says otherwise."""
    runner = _RUNNER[0] if _RUNNER else None
    if runner is not None and runner.closed:
        raise RuntimeError("the session ended before this run started")
    proc = subprocess.Popen(command, start_new_session=True, **{"cwd": _CWD, **kwargs})
    if runner is not None:
        runner.procs.append(proc)
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (it and its children) if it is still running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


class Runner:
    """The session's background jobs, one after another on one thread."""

    def __init__(self, names: list[str]) -> None:
        self.born = time.monotonic()
        self.folder = Path(tempfile.mkdtemp(prefix="muon_dtensor_jobs_"))
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background")
        self.futures: dict[str, Future[Any]] = {}
        self.add(names)

    def add(self, names: list[str]) -> None:
        for name in names:
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self._run, name)

    def _run(self, name: str) -> Any:
        folder = self.folder / name
        folder.mkdir()
        begin = time.monotonic() - self.born
        try:
            return JOBS[name](folder)
        finally:
            here = "" if threading.current_thread().name.startswith("background") else " (session)"
            TIMES.append((name + here, begin, time.monotonic() - self.born))

    def steal(self, name: str) -> bool:
        """Run job ``name`` in the calling thread (the session's) if the background thread has not
        started it; False if it has."""
        if not self.futures[name].cancel():
            return False
        mine: Future[Any] = Future()
        mine.set_running_or_notify_cancel()
        self.futures[name] = mine
        try:
            mine.set_result(self._run(name))
        except BaseException as e:  # noqa: BLE001 - raised in each of the job's readers
            mine.set_exception(e)
        return True

    def steal_last(self) -> bool:
        """Run the last job the background thread has not started, in the calling thread."""
        return any(self.steal(name) for name in reversed(list(self.futures)))

    def close(self) -> None:
        """Kill what still runs (an interrupted session), then remove the outputs."""
        self.closed = True
        for future in self.futures.values():
            future.cancel()
        for proc in self.procs:
            kill(proc)
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.folder, ignore_errors=True)


_RUNNER: list[Runner] = []


def start(names: list[str]) -> None:
    """Start ``names`` (conftest.py, at the end of collection)."""
    if _RUNNER:
        _RUNNER[0].add(names)
    elif names:
        _RUNNER.append(Runner(names))


def result(name: str) -> Any:
    """Job ``name``'s result, once it is done (started now if nothing started it). A reader does
    not wait idle: it runs ``name`` itself if the background thread has not started it, else the
    last job not started, until ``name`` is done (the session's tests are done by then; two threads
    share the jobs left, as the two cores do)."""
    start([name])
    runner = _RUNNER[0]
    while not runner.futures[name].done() and (runner.steal(name) or runner.steal_last()):
        pass
    return runner.futures[name].result()


def folder(name: str) -> Path:
    """The folder job ``name`` ran in, for a reader that checks the files it left (they stay until
    the session ends)."""
    return _RUNNER[0].folder / name


def stop() -> None:
    while _RUNNER:
        _RUNNER.pop().close()
