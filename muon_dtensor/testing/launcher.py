"""The launcher ``run_ranks`` starts its ranks with. On Linux, when the ranks use no GPU, a launcher
process imports torch and its distributed packages once and forks every rank from it: each rank is
still a process of its own that has run nothing but those imports, and a launch costs a fork instead
of an interpreter's start per rank (importing torch is seconds of CPU, and the ranks share the host's
cores). Elsewhere (a GPU per rank, where a fork after CUDA's set-up is unsafe; other systems) each
rank is an interpreter of its own, as ``multiprocessing``'s spawn starts them.

A process that launches again with the same environment reuses its launcher (kept while
the process lives), so the import is paid once per process and environment: the demo launches six
times, a resume check three. A launcher whose environment differs would have imported torch under
another one, so each environment gets its own (the two newest are kept). Only the main thread
reuses one: a launcher dies with the thread that started it (``PR_SET_PDEATHSIG``), and a launch
from another thread, or while the launcher is busy, gets a launcher of its own for that launch.

A kept launcher serves a launch only while what it imported still holds: the package's source files
are unchanged (same size and modification time, read by the caller before the launcher started, so
an edit made while it imported counts) and the caller's umask is the one it started under (the
ranks' files take it); otherwise a fresh one starts. A source file changed since the last launch
also loses its cached bytecode: Python trusts a ``.pyc`` whose recorded size and whole-second
modification time match, so an edit of the same size within the same second would otherwise run
the old code in the fresh launcher and in every rank. A
launcher runs in a session of its own, so a Ctrl-C at the terminal reaches the caller alone, which
kills the launch's launcher, and with it every rank (``run_ranks``); a rank's stdin is /dev/null.

A forked rank dies with its launcher, so killing the launcher at a deadline kills every rank.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from .rank import worker

# The public building blocks of a fork server (tests/harness/ranks.py and forkrun.py are two);
# ``launch`` and ``Launch`` are ``run_ranks``'s own.
__all__ = ["die_with_parent", "exit_code", "fork_ranks", "preload", "rank_stderr", "reap"]

# What every rank imports anyway; the environment is the ranks' own, so an import reads the same.
# torch._dynamo: fully_shard imports it at its first call (torch/_compile.py, _disable_dynamo),
# 0.8 s in every rank that shards a model when the launcher has not.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch._dynamo",
)
# Imported too where they import (a bad setting they check at import then fails in each rank, with
# its traceback): the optimizer and the checkpoint helpers, which nearly every rank function uses.
OURS = ("muon_dtensor.optim.optimizer", "muon_dtensor.checkpoint")
KEPT = 2  # launchers kept per process, one per environment: a test's changed environment and the usual one
# What no import reads, so not a reason for a launcher of its own (each rank still gets the caller's
# value): what pytest changes for every test, and the inductor cache folder, which torch reads when it
# first needs it and sets then in the process that asked (torch._inductor.runtime.cache_dir_utils),
# so a caller that touched the cache once had every later launch start a launcher again.
VOLATILE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")


class Launch:
    """One launch, as ``run_ranks`` waits for it: ``poll()`` is None until every rank's exit code is in
    ``tmp/exit<rank>`` (or the launcher died), then the largest; ``kill()`` kills the launcher, and
    with it every rank."""

    def __init__(self, proc: subprocess.Popen, tmp: Path, world_size: int, done: Callable[[], None]) -> None:
        self.proc, self.tmp, self.world_size, self._done = proc, tmp, world_size, done

    def poll(self) -> int | None:
        codes = [exit_code(self.tmp / f"exit{r}") for r in range(self.world_size)]
        code = max(codes) if None not in codes else self.proc.poll()  # type: ignore[type-var]
        if code is not None:
            self._done()
        return code

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._done()

    def wait(self) -> int:
        return self.proc.wait()


def launch(spec: str, world_size: int, tmp: str, env: dict[str, str]) -> Launch:
    """Fork ``world_size`` ranks running ``spec`` (see ``rank.worker``) from a launcher that
    imported torch with ``env``: this process's kept one where it can, else one for this launch."""
    request = json.dumps([spec, world_size, tmp, env, os.getcwd()]) + "\n"
    _forget_changed_bytecode()
    if threading.current_thread() is threading.main_thread():
        server = _server(env)
        if server is not None:
            try:
                assert server.stdin is not None
                server.stdin.write(request.encode())
                server.stdin.flush()
                return Launch(server, Path(tmp), world_size, lambda: _BUSY.discard(server.pid))
            except (BrokenPipeError, ValueError):  # it died since: a launcher for this launch
                _drop(server)
    once = _start(env)
    _STAMPS.pop(once.pid, None)  # it serves this launch only: never asked whether it is stale
    assert once.stdin is not None
    once.stdin.write(request.encode())
    once.stdin.close()  # it serves this launch only
    return Launch(once, Path(tmp), world_size, _nothing)


_SERVERS: dict[tuple[tuple[tuple[str, str], ...], int], subprocess.Popen] = {}  # newest last
_BUSY: set[int] = set()  # the pids of kept launchers with a launch in flight
_STAMPS: dict[int, dict[str, tuple[int, int]]] = {}  # launcher pid -> ``sources()`` before it started
_READY: set[int] = set()  # launchers whose first line (their imports done) was read
_SEEN: dict[str, tuple[int, int]] = {}  # ``sources()`` at the last launch
_PACKAGE = Path(__file__).resolve().parents[1]


def _server(env: dict[str, str]) -> subprocess.Popen | None:
    """The kept launcher for ``env``, started if needed and marked busy; None while it is busy."""
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE)), umask())
    server = _SERVERS.pop(key, None)
    if server is not None and (server.poll() is not None or (server.pid not in _BUSY and _stale(server))):
        _drop(server)
        server = None
    _SERVERS[key] = server = server or _start(env)
    while len(_SERVERS) > KEPT:
        _drop(next(iter(_SERVERS.values())))
    if server.pid in _BUSY:
        return None
    _BUSY.add(server.pid)
    return server


def _start(env: dict[str, str]) -> subprocess.Popen:
    """A launcher that imports under ``env`` and serves the requests written to its input; its first
    line of output is its ``stamp``. In a session of its own: a terminal's Ctrl-C is the caller's.
    The package's sources are read before it starts: any later edit makes it stale."""
    before = sources()
    command = [sys.executable, "-m", __name__, str(os.getpid())]
    server = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    _STAMPS[server.pid] = before
    return server


def stamp() -> list[tuple[str, int, int]]:
    """The file, size and modification time (ns) of every muon_dtensor module imported here."""
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if (name == "muon_dtensor" or name.startswith("muon_dtensor.")) and file:
            with contextlib.suppress(OSError):
                st = os.stat(file)
                found.append((file, st.st_size, st.st_mtime_ns))
    return sorted(found)


def sources(package: Path = _PACKAGE) -> dict[str, tuple[int, int]]:
    """The size and modification time (ns) of every ``.py`` file under ``package``, read now."""
    found = {}
    for path in package.rglob("*.py"):
        with contextlib.suppress(OSError):
            st = path.stat()
            found[str(path)] = (st.st_size, st.st_mtime_ns)
    return found


def forget_bytecode(files: list[str]) -> None:
    """Remove the cached bytecode of ``files``, so the next import compiles their source."""
    for file in files:
        with contextlib.suppress(OSError, ValueError, NotImplementedError):
            os.remove(importlib.util.cache_from_source(file))


def _forget_changed_bytecode() -> None:
    """Before a launch: the bytecode of every source changed since the last launch is removed."""
    now = sources()
    if _SEEN:
        forget_bytecode([f for f, seen in now.items() if _SEEN.get(f) != seen])
    _SEEN.clear()
    _SEEN.update(now)


def _stale(server: subprocess.Popen) -> bool:
    """Whether a source file changed since ``server`` started, or it died before serving (its first
    line, written once its imports were done, is read once: its first launch has ended)."""
    if server.pid not in _READY:
        assert server.stdout is not None
        if not server.stdout.readline():  # it died before serving
            return True
        _READY.add(server.pid)
    return sources() != _STAMPS.get(server.pid)


def umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting and restoring it."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _drop(server: subprocess.Popen) -> None:
    """Stop a kept launcher (it leaves at the end of its input; killed if it hangs)."""
    for key in [k for k, s in _SERVERS.items() if s is server]:
        del _SERVERS[key]
    _BUSY.discard(server.pid)
    _STAMPS.pop(server.pid, None)
    _READY.discard(server.pid)
    with contextlib.suppress(OSError, ValueError):
        server.stdin.close()  # type: ignore[union-attr]
    with contextlib.suppress(OSError, ValueError):
        server.stdout.close()  # type: ignore[union-attr]
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@atexit.register
def _stop_servers() -> None:
    while _SERVERS:
        _drop(next(iter(_SERVERS.values())))


def _nothing() -> None:
    pass


def exit_code(path: Path) -> int | None:
    """The exit code ``reap`` wrote to ``path``; None until it has."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):  # not reaped yet
        return None


def preload() -> None:
    """What a launcher imports before it forks: ``PRELOAD``, then ``OURS`` where they import."""
    for name in PRELOAD:
        importlib.import_module(name)
    for name in OURS:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def reap(ranks: dict[int, int], folder: Path) -> None:
    """Wait for every child in ``ranks`` (pid -> rank), writing each one's exit code to
    ``folder/exit<rank>`` as it is reaped (whole, by a rename)."""
    while ranks:
        pid, status = os.wait()
        part = folder / f"exit{ranks[pid]}.part"
        part.write_text(str(os.waitstatus_to_exitcode(status)))
        part.rename(folder / f"exit{ranks.pop(pid)}")


def _serve(parent: int) -> None:
    """The launcher: import, then for each request (a line of its input) fork its ranks and reap
    them, writing each rank's exit code to ``exit<rank>`` in the launch's folder; leave at its end."""
    die_with_parent(parent)
    preload()
    sys.stdout.write(json.dumps(stamp()) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the ranks' output is dropped, as before: nobody reads this pipe again
    os.close(devnull)
    threaded = len(os.listdir("/proc/self/task")) > 1  # a thread now would be copied half-way into a fork
    for line in sys.stdin:
        spec, world_size, tmp, env, cwd = json.loads(line)
        reap((_spawn if threaded else _fork)(spec, world_size, tmp, env, cwd), Path(tmp))
    os._exit(0)


def _fork(spec: str, world_size: int, tmp: str, env: dict[str, str], cwd: str) -> dict[int, int]:
    """Each rank where the caller is now: its folder, and its environment (a VOLATILE variable may
    differ from this launcher's; no thread runs in the rank yet, so setenv is safe)."""

    def rank(r: int) -> int:
        os.chdir(cwd)
        if os.environ != env:
            os.environ.clear()
            os.environ.update(env)
        rank_stderr(Path(tmp, f"stderr{r}"))
        worker(spec, r, world_size, tmp)  # leaves with os._exit
        return 1

    return fork_ranks(world_size, rank)


def _spawn(spec: str, world_size: int, tmp: str, env: dict[str, str], cwd: str) -> dict[int, int]:
    """One interpreter per rank, each dying with this launcher; pid -> rank."""
    me, procs = os.getpid(), {}
    for r in range(world_size):
        with open(Path(tmp, f"stderr{r}"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "muon_dtensor.testing.rank", spec, str(r), str(world_size), tmp],
                stdin=subprocess.DEVNULL,
                stderr=log,
                env=env,
                cwd=cwd,
                preexec_fn=lambda: die_with_parent(me),  # noqa: PLW1509 - one call, then exec
            )
        procs[proc.pid] = r
    return procs


def fork_ranks(world_size: int, body: Callable[[int], int]) -> dict[int, int]:
    """Fork ``world_size`` children, each dying with this process, running ``body(rank)`` and leaving
    with its return value as exit code (1 and the traceback if it raises): a child never returns
    into the caller's code. Returns pid -> rank. Output buffered here is flushed first."""
    parent, children = os.getpid(), {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                die_with_parent(parent)
                code = body(rank)
            except BaseException:  # noqa: BLE001 - the rank failed: say why, then leave
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    return children


def rank_stderr(log: Path) -> None:
    """This process's stderr to ``log`` (appended)."""
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 2)


def die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when ``parent`` dies, whatever it is blocked in."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
