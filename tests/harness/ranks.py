"""A pool of rank processes per world size, kept for the whole pytest session.

``run_ranks(fn, world_size, *args, timeout=...)`` has the signature and the results of
``muon_dtensor.testing.run_ranks``: each rank runs ``module:function(*args)`` and the call returns
every rank's return value, or raises ``RankError`` with the failing rank's traceback. The difference is
that the ranks are not fresh processes: one pool per world size (1, 2, 4) is started on first use, its
launcher (a fork of the session's zygote, tests/harness/zygote.py, which imported torch once) forks the
workers, each joins a gloo process group once, then loops over tasks read from its own FIFO (the
pattern of torch's ``MultiProcContinuousTest``). That takes the seconds of start-up and rendezvous
off every call.

Safety rules: every call has a deadline; a rank that raises, hangs or dies makes the whole pool be killed
(a rank that raised may have left the others waiting in a collective) and the next call starts a new one;
so is a pool where a step failed inside its data path (the job's store keeps that for good).
Every task starts from the same RNG state (seed 0, on every rank). Process groups that tasks create (every
device mesh makes some) stay alive: torch's caches keep equal meshes from earlier calls (destroying the
groups after each task made a later task get a mesh whose group was gone), so instead a pool whose
workers hold more than MAX_THREADS threads (gloo keeps threads per group, each polling) is retired after the
call. A
worker exits when the session closes its FIFO and dies with its launcher, which dies with pytest
(PR_SET_PDEATHSIG), if killed.

Tests that need fresh processes (a rank that calls ``os._exit`` on purpose, patched package internals,
per-run environment) use ``muon_dtensor.testing.run_ranks`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from muon_dtensor.testing import RankError
from muon_dtensor.testing.launcher import VOLATILE, exit_code
from tests.harness.zygote import Forked, Zygote, process_state

__all__ = ["STARTS", "RankError", "process_state", "run_apart", "run_ranks", "shutdown", "zygote_aside"]

START_TIMEOUT = 180.0  # seconds for a pool to import torch and meet; 2 busy cores can be slow
GRACE = 3.0  # seconds the other ranks get to report once one rank has failed
WAKE = 0.1  # seconds a waiting call sleeps at most between looks at its workers' exits
# Per worker; about 6 per process group, so some 25 device meshes. Each live gloo group's loop thread
# wakes every few ms, so an idle worker's CPU grows with the groups it holds: a restart (one torch
# import) is cheaper than keeping hundreds of groups (tests/README.md, "Pool retirement").
MAX_THREADS = 150


# Every pool started in this session: (world size, seconds to start, the test that started it, whether
# the zygote forked its launcher). A pool starts on first use and again after one is retired;
# conftest.py prints the summary.
STARTS: list[tuple[int, float, str, bool]] = []


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on every rank of the pooled ``world_size`` group; return each rank's value."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None and not pool.alive():  # a worker died between calls
        pool.close(kill=True)
        pool = None
    pool = _POOLS[world_size] = pool or _Pool(world_size)
    try:
        pool.signal(signal.SIGCONT)
        values, threads, failed = pool.run(*_task(fn), args, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
        raise
    if threads > MAX_THREADS or failed:
        _POOLS.pop(world_size, None)
        pool.close()
    else:
        pool.signal(signal.SIGSTOP)  # idle until its next call: no gloo loop thread polls meanwhile
    return values


def run_apart(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``run_ranks`` on a pool of its own, started for this call and closed after it: for a background
    job's thread (tests/harness/background.py), beside the session's pools. Its launcher is a fork of
    the zygote, under the zygote's environment: no interpreter imports torch for it (a job that ran
    ``muon_dtensor.testing.run_ranks`` in a ``python -c`` imported torch twice, 5 to 6 s of a core)."""
    # the zygote's environment, and its fork, while no test sets it aside (held until the pool is up)
    with _ZYGOTE_LOCK:
        env = _ZYGOTE[0].env if _ZYGOTE else _pool_env()
        pool = _Pool(world_size, env, f"{_task(fn)[0]} (apart)")
    try:
        values = pool.run(*_task(fn), args, timeout)[0]
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()
    return values


def shutdown() -> None:
    """Stop every pool (the session's end); workers leave their loop when their stdin closes."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def _task(fn: Callable[..., Any]) -> tuple[str, str]:
    """``fn``'s ``module:qualname`` and the folder its module was imported from, as a worker reads them."""
    return f"{fn.__module__}:{fn.__qualname__}", _import_root(fn.__module__)


def _import_root(module: str) -> str:
    """The folder ``module`` was imported from, so the workers import the same code."""
    file = sys.modules[module].__file__
    assert file is not None
    depth = module.count(".") + (Path(file).name == "__init__.py")
    return str(Path(file).resolve().parents[depth])


def _pool_env() -> dict[str, str]:
    """The environment of every pool's launcher and workers: this session's, with one thread."""
    roots = [_import_root(__name__), _import_root("muon_dtensor"), os.environ.get("PYTHONPATH")]
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(filter(None, roots))),
        "MUON_DTENSOR_POOL_PARENT": str(os.getpid()),  # the launcher dies with this session
    }


def start_zygote() -> None:
    """Start the session's zygote now (pytest_configure: its imports overlap the collection, 15 s
    of one core on an AVX2 host); it is provisional until it forks a launcher: the first pool
    asked for under another environment replaces it instead of starting an interpreter."""
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(_pool_env()))


class _Pool:
    """``world_size`` worker processes, one gloo group, task files and result files in one folder."""

    def __init__(self, world_size: int, env: dict[str, str] | None = None, cause: str | None = None) -> None:
        start = time.monotonic()
        self.world_size = world_size
        self.folder = Path(tempfile.mkdtemp(prefix=f"muon_dtensor_pool{world_size}_"))
        self.tasks = itertools.count()
        env = env or _pool_env()
        for r in range(world_size):
            (self.folder / f"stderr{r}").touch()
            os.mkfifo(self.folder / f"tasks{r}")  # a task line per worker
        # A byte per result, so a waiting call sleeps in select instead of polling the result files
        # (every 5 ms: 0.08 to 0.12 CPU s per second of waiting). Read-write: no EOF without workers.
        os.mkfifo(self.folder / "done")
        self.done = os.open(self.folder / "done", os.O_RDWR | os.O_NONBLOCK)
        # read-write: the open does not wait for the worker; its EOF comes when this end closes
        writes = [os.open(self.folder / f"tasks{r}", os.O_RDWR) for r in range(world_size)]
        self.launcher = _launcher(env, self.folder, world_size)
        self.procs = [
            _Worker(self.launcher, self.folder, r, os.fdopen(w, "wb")) for r, w in enumerate(writes)
        ]
        self._wait_ready()
        test = cause or os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        forked = isinstance(self.launcher, Forked)
        STARTS.append((world_size, time.monotonic() - start, test, forked))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not all((self.folder / f"ready{r}").exists() for r in range(self.world_size)):
            if not self.alive() or time.monotonic() > deadline:
                why = "a worker died" if not self.alive() else f"not ready after {START_TIMEOUT:.0f} s"
                message = f"pool of {self.world_size} failed to start ({why})\n{self._stderr({})}"
                self.close(kill=True)
                raise RankError(message)
            time.sleep(0.02)

    def run(self, spec: str, root: str, args: tuple, timeout: float) -> tuple[list[Any], int, bool]:
        """Each rank's value, the most threads a worker holds after the task, and whether a step
        failed on some rank (recorded in the job's store for good: the pool is retired)."""
        task = next(self.tasks)
        offsets = {r: (self.folder / f"stderr{r}").stat().st_size for r in range(self.world_size)}
        part = self.folder / f"task{task}.pkl.part"
        part.write_bytes(pickle.dumps((spec, root, args)))
        part.rename(self.folder / f"task{task}.pkl")
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(f"{task}\n".encode())
                p.stdin.flush()
        except BrokenPipeError:
            pass  # a worker is gone: _collect reports it with its stderr
        outcomes, hung = self._collect(task, timeout)
        (self.folder / f"task{task}.pkl").unlink()  # read by every rank that reported
        exits = [p.poll() for p in self.procs]
        values = _judge(outcomes, exits, hung, timeout, self._stderr(offsets))
        return values, max(o[2] for o in outcomes.values()), any(o[3] for o in outcomes.values())

    def _collect(self, task: int, timeout: float) -> tuple[dict[int, tuple[str, Any, int, bool]], bool]:
        """Every rank's (status, value, threads, step failed) as far as it came; True if the deadline passed.
        Once a rank failed or died, the others get GRACE seconds: they may be stuck in a collective."""
        deadline = time.monotonic() + timeout
        outcomes: dict[int, tuple[str, Any, int, bool]] = {}
        while True:
            silent_before = [r for r in range(self.world_size) if r not in outcomes]
            exited = [self.procs[r].poll() is not None for r in silent_before]  # before reading: no race
            for r in silent_before:
                path = self.folder / f"result{task}.{r}.pkl"
                if path.exists():
                    outcomes[r] = pickle.loads(path.read_bytes())
                    path.unlink()
                    if outcomes[r][0] == "error":
                        deadline = min(deadline, time.monotonic() + GRACE)
            silent = [r for r, gone in zip(silent_before, exited) if gone and r not in outcomes]
            if len(outcomes) == self.world_size or (
                silent and len(silent) + len(outcomes) == self.world_size
            ):
                return outcomes, False  # everyone reported, or every silent rank is dead
            if any(exited):
                deadline = min(deadline, time.monotonic() + GRACE)
            if time.monotonic() > deadline:
                return outcomes, True
            self._sleep(min(WAKE, max(0.0, deadline - time.monotonic())))

    def _sleep(self, seconds: float) -> None:
        """Until a worker reports a result, or ``seconds`` (a rank that dies writes nothing)."""
        if select.select([self.done], [], [], seconds)[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(self.done, 1 << 16)

    def _stderr(self, offsets: dict[int, int]) -> str:
        parts = []
        for r in range(self.world_size):
            data = (self.folder / f"stderr{r}").read_bytes()[offsets.get(r, 0) :]
            code = self.procs[r].poll()
            state = "running" if code is None else f"exit {code}"
            parts.append(f"--- rank {r} stderr ({state}) ---\n{data[-3000:].decode(errors='replace')}")
        return "\n".join(parts)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the launcher and its workers (SIGSTOP between calls, SIGCONT before)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.launcher.pid, signum)

    def close(self, kill: bool = False) -> None:
        self.signal(signal.SIGCONT)  # a stopped worker would never read its EOF
        for p in self.procs:
            if not p.stdin.closed:
                with contextlib.suppress(BrokenPipeError):
                    p.stdin.close()  # a worker leaves its loop at EOF, the launcher once all have
        if kill:
            self.launcher.kill()  # its workers die with it (PR_SET_PDEATHSIG)
        try:
            self.launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            self.launcher.wait()
        with contextlib.suppress(OSError):
            os.close(self.done)
        shutil.rmtree(self.folder, ignore_errors=True)


class _Worker:
    """One forked worker, as the pool sees it: its task FIFO and its exit code, which the launcher
    writes to ``exit<rank>`` when it reaps the worker (the launcher's own code if it died first)."""

    def __init__(
        self, launcher: Forked | subprocess.Popen, folder: Path, rank: int, stdin: IO[bytes]
    ) -> None:
        self.launcher, self.exit, self.stdin = launcher, folder / f"exit{rank}", stdin

    def poll(self) -> int | None:
        code = exit_code(self.exit)
        return code if code is not None else self.launcher.poll()


def _judge(outcomes: dict, exits: list[int | None], hung: bool, timeout: float, stderr: str) -> list[Any]:
    """The values in rank order, or RankError with the first rank's own error, as launch reports it.
    ``exits``: each worker's exit code, None while it runs."""
    errors = {r: v for r, (status, v, *_) in outcomes.items() if status == "error"}
    silent = [r for r in range(len(exits)) if r not in outcomes]
    if errors:
        # A rank's own error first; "Connection reset" is usually another rank's consequence.
        first = min(errors, key=lambda r: ("Connection reset" in errors[r], r))
        rest = "".join(
            f"\n--- also rank {r}: {v.strip().splitlines()[-1]}" for r, v in errors.items() if r != first
        )
        others = f"\nranks without a result: {silent}\n{stderr}" if silent else ""
        raise RankError(
            f"rank {first} failed{' (others hung)' if hung else ''}:\n{errors[first]}{rest}{others}"
        )
    if silent:
        dead = [r for r in silent if exits[r] is not None]
        if dead:
            raise RankError(f"rank {dead[0]} died without a result (exit code {exits[dead[0]]})\n{stderr}")
        raise RankError(f"rank {silent[0]} timed out after {timeout:.0f} s (hang?)\n{stderr}")
    return [outcomes[r][1] for r in range(len(exits))]


_POOLS: dict[int, _Pool] = {}
atexit.register(shutdown)


def _launcher(env: dict[str, str], folder: Path, world_size: int) -> Forked | subprocess.Popen:
    """The pool's launcher: forked by the session's zygote where the environment is the zygote's
    (``VOLATILE`` aside, as the kept launchers of ``muon_dtensor.testing`` compare), else an
    interpreter of its own. One caller at a time: a background job's pool asks the zygote too."""
    with _ZYGOTE_LOCK:
        return _fork_or_start(env, folder, world_size)


def _fork_or_start(env: dict[str, str], folder: Path, world_size: int) -> Forked | subprocess.Popen:
    if _ZYGOTE and not _ZYGOTE[0].forked and _steady(_ZYGOTE[0].env) != _steady(env):
        _close_zygote()  # started early, never used: the first pool's environment is the zygote's
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [Zygote(env)]
    zygote = _ZYGOTE[0]
    if _steady(zygote.env) == _steady(env):
        forked = zygote.fork(str(folder), world_size, START_TIMEOUT, env)
        if forked is not None:
            return forked
    with open(folder / "stderr0", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", __name__, str(folder), str(world_size)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,  # the launcher and its workers: one group to stop and continue
        )


_ZYGOTE: list[Zygote] = []
# A request to the zygote and its answer, one caller at a time; held by ``zygote_aside`` too.
_ZYGOTE_LOCK = threading.RLock()


@contextlib.contextmanager
def zygote_aside() -> Iterator[None]:
    """For a test of the zygote itself: the session's zygote set aside (not closed: it forked the
    pools of ``run_apart`` that may be running) and restored after; the zygotes made meanwhile are
    closed. ``run_apart`` waits meanwhile, so it never forks from the test's zygote."""
    with _ZYGOTE_LOCK:
        kept = _ZYGOTE[:]
        _ZYGOTE.clear()
        try:
            yield
        finally:
            _close_zygote()
            _ZYGOTE[:] = kept


def _steady(env: dict[str, str]) -> dict[str, str]:
    """What an import may read of ``env``: the launcher's ``VOLATILE`` aside (torch sets one of them,
    the inductor cache folder, in the session when it first needs it: once a test had touched the
    cache, every later pool imported torch again, 3 of 3 in tests/checkpoint's resume tests)."""
    return {k: v for k, v in env.items() if k not in VOLATILE}


def _close_zygote() -> None:
    while _ZYGOTE:
        _ZYGOTE.pop().close()


atexit.register(_close_zygote)


def launch_pool(folder: str, world_size: int) -> None:
    """The pool's launcher: fork one worker per rank (its task FIFO as stdin, its stderr to its own
    log), record each worker's exit code as it is reaped. Its own stderr is rank 0's log."""
    from muon_dtensor.testing.launcher import fork_ranks, preload, rank_stderr, reap

    rank_stderr(Path(folder, "stderr0"))
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # not the zygote's request pipe, nor its answers
        os.dup2(devnull, fd)
    os.close(devnull)
    preload()  # done already where a zygote forked this launcher

    def worker(rank: int) -> int:
        rank_stderr(Path(folder, f"stderr{rank}"))
        sys.stdin = open(Path(folder, f"tasks{rank}"))  # noqa: SIM115 - the worker's for its lifetime
        _serve(Path(folder), rank, world_size)  # leaves with os._exit
        return 1

    reap(fork_ranks(world_size, worker), Path(folder))
    os._exit(0)


def _serve(folder: Path, rank: int, world_size: int) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a crash in native code leaves its Python stacks in the log
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
    done = os.open(folder / "done", os.O_WRONLY | os.O_NONBLOCK)  # the session holds it open
    (folder / f"ready{rank}").touch()
    for line in sys.stdin:  # one task number per line; EOF: the session is over
        task = int(line)
        outcome = _run_task(pickle.loads((folder / f"task{task}.pkl").read_bytes()))
        part = folder / f"result{task}.{rank}.pkl.part"
        try:
            part.write_bytes(pickle.dumps((*outcome, _threads(), _step_failed())))
        except Exception:  # noqa: BLE001 - an unpicklable return value is the task's error
            import traceback

            part.write_bytes(pickle.dumps(("error", traceback.format_exc(), _threads(), _step_failed())))
        part.rename(folder / f"result{task}.{rank}.pkl")
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the session anyway
            os.write(done, b"x")
    sys.stderr.flush()
    os._exit(0)  # no gloo destructor at exit (see muon_dtensor.testing)


def _threads() -> int:
    """This process's thread count: each process group a task makes keeps gloo threads alive."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _step_failed() -> bool:
    """Whether a rank reported a step's failure (``failures.releasing_peers``) in this pool's store."""
    import torch.distributed as dist

    from muon_dtensor.sharding.runtime.failures import FAILED_KEY

    return bool(dist.distributed_c10d._get_default_store().check([FAILED_KEY]))


def _run_task(task: tuple[str, str, tuple]) -> tuple[str, Any]:
    import importlib
    import random
    import traceback

    import torch

    spec, root, args = task
    if root not in sys.path:
        sys.path.insert(0, root)
    torch.manual_seed(0)  # results must not depend on which tasks ran before in this process
    random.seed(0)
    try:
        module, name = spec.split(":")
        return ("ok", getattr(importlib.import_module(module), name)(*args))
    except BaseException:  # noqa: BLE001 - report every failure, CheckpointException included
        return ("error", traceback.format_exc())


if __name__ == "__main__":
    from muon_dtensor.testing.launcher import die_with_parent

    die_with_parent(int(os.environ["MUON_DTENSOR_POOL_PARENT"]))
    launch_pool(sys.argv[1], int(sys.argv[2]))
