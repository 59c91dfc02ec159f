"""One process per session that imports what every pool's launcher imports, then forks a launcher
for each pool (tests/harness/ranks.py) on request. A pool that starts, or starts again after it was
retired, then costs a fork and a gloo rendezvous instead of an interpreter that imports torch: 2.6 to
2.9 s of wall time per start on this 2-core host, 11 starts in the whole suite (tests/README.md).

The zygote is started with the pools' environment; a pool asked for under another environment gets
a launcher of its own, as before. It dies with the session (PR_SET_PDEATHSIG), each launcher dies with
it, and each worker with its launcher. The zygote reaps each launcher as it ends, so the session sees
a launcher end as its process being gone (or a zombie for a moment).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["Forked", "Zygote", "process_state"]

# What the rank functions' test modules import besides the launcher's preload: every worker of every
# pool imported them again (0.3 s each in a profile of tests/checkpoint's resume tests).
SHARED = ("pytest", "tests.helpers.models", "tests.helpers.pipeline")
# The integrations' libraries, imported while no request waits: 23 workers of a suite imported one
# or more of them, 1.7 to 2.1 CPU s each (torchtitan's llama3 and deepseek_v3, transformers' Llama,
# lightning). A launcher forked before one is in imports it itself, as before; one not installed is
# skipped.
IDLE = (
    "transformers.models.llama.modeling_llama",
    "accelerate",
    "lightning.pytorch",
    "lightning.fabric.strategies",
    "torchtitan.models.llama3",
    "torchtitan.models.deepseek_v3",
)


def process_state(pid: int) -> str:
    """A process's state letter from /proc (R, S, T stopped, Z zombie, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


class Forked:
    """A launcher the zygote forked, as ``subprocess.Popen`` is used for one: its pid, ``poll``,
    ``kill`` and ``wait``. Its exit code is the zygote's to read: 1 here once it is gone."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return 1 if process_state(self.pid) in ("Z", "X", "gone") else None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"launcher {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return code


class Zygote:
    """The session's zygote for ``env``: ``fork(folder, world_size)`` returns a ``Forked`` launcher,
    or None when the zygote is gone (the caller starts a launcher of its own)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.forked = False  # whether it has forked a launcher yet
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the session's, as for every launcher
        )

    def fork(self, folder: str, world_size: int, timeout: float, env: dict[str, str]) -> Forked | None:
        """A launcher whose environment is ``env`` (the caller checked that it differs from the
        zygote's only in what no import reads)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps([folder, world_size, env]).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            return None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)  # its imports, at first
        line = self.proc.stdout.readline() if ready else b""
        self.forked = self.forked or bool(line.strip())
        return Forked(int(line)) if line.strip() else None

    def close(self) -> None:
        self.proc.kill()  # its launchers and their workers die with it
        self.proc.wait()


def _reap(*_: object) -> None:
    """Reap every launcher that has ended (waited for, so its CPU seconds reach this process's
    children's, which the session's CPU accounting reads: tests/harness/cpu_per_test.py)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _requests(idle: list[str]) -> Iterator[bytes]:
    """Request lines from stdin; while none is waiting, the next module of ``idle`` is imported."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line
        if idle and not select.select([0], [], [], 0)[0]:
            with contextlib.suppress(Exception):  # not installed, or broken: its tests will say
                importlib.import_module(idle.pop(0))
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return
        buffer += chunk


def _serve(parent: int) -> None:
    """Import as a pool's launcher does, then fork one launcher per request line and write its pid."""
    from muon_dtensor.testing.launcher import die_with_parent, preload
    from tests.harness.ranks import launch_pool

    die_with_parent(parent)
    preload()
    for name in SHARED:
        importlib.import_module(name)
    me = os.getpid()
    signal.signal(signal.SIGCHLD, _reap)  # reaped here, not by the kernel: their CPU counts
    for line in _requests(list(IDLE)):
        folder, world_size, env = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()  # the launcher and its workers: one group to stop and continue
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its own workers
            try:
                os.environ.clear()
                os.environ.update(env)  # the workers' environment is the pool's, as for a Popen launcher
                die_with_parent(me)
                launch_pool(folder, world_size)  # leaves with os._exit
            except BaseException:  # noqa: BLE001 - say why in the pool's log, then leave
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _serve(int(os.environ["MUON_DTENSOR_POOL_PARENT"]))
