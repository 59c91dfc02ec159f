"""``python -m tests.harness.forkrun N script [args...]``: what ``torchrun --standalone --nproc_per_node=N script
args`` does for a script on one host, in one process that imports torch once and forks the N ranks.
Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and runs the script as ``__main__`` with the script's folder first on
its path. As under torchrun, once a rank fails the others are killed (after a few seconds' grace),
and the exit code is the first failing rank's. It spares a test the agent's and every rank's
interpreter start (seconds of CPU each); tests/e2e/test_examples.py still launches with torchrun itself.
"""

from __future__ import annotations

import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

from muon_dtensor.testing.launcher import fork_ranks, preload

GRACE = 5.0  # seconds the other ranks get once one has failed


def main(nproc: int, script: str, args: list[str]) -> int:
    preload()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)}
    env["LOCAL_WORLD_SIZE"] = str(nproc)

    def rank(r: int) -> int:
        return _run(script, args, {**env, "RANK": str(r), "LOCAL_RANK": str(r)})

    return _wait(fork_ranks(nproc, rank))


def _run(script: str, args: list[str], env: dict[str, str]) -> int:
    """The script as ``__main__`` in this rank; its exit code (a traceback and 1 if it raises)."""
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _wait(ranks: dict[int, int]) -> int:
    """Reap every rank; once one fails, kill the rest after GRACE. The first failure's exit code."""
    first, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = None
            time.sleep(0.02)
            continue
        ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first == 0:
            first, deadline = code if code > 0 else 1, time.monotonic() + GRACE
    return first


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3:]))
