"""The launcher ``run_ranks`` starts its ranks with. On Linux, when the ranks use no GPU, one launcher process
imports torch and its distributed packages once and forks every rank from it: each rank is still a
process of its own that has run nothing but those imports, and the launch costs one interpreter's
start instead of one per rank (importing torch is seconds of CPU, and the ranks share the host's
cores). Elsewhere (a GPU per rank, where a fork after CUDA's set-up is unsafe; other systems) each
rank is an interpreter of its own, as ``multiprocessing``'s spawn starts them.

A forked rank dies with the launcher (``PR_SET_PDEATHSIG``), so killing the launcher at the
deadline kills every rank; the launcher leaves once every rank has.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["PRELOAD"]

# What every rank imports anyway; the environment is the ranks' own, so an import reads the same.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
)


def _launch(spec: str, world_size: int, tmp: str) -> None:
    """The launcher: import, fork each rank (its stderr to its own log), wait for all of them."""
    for name in PRELOAD:
        importlib.import_module(name)
    from .testing import _worker

    launcher = os.getpid()
    if len(os.listdir("/proc/self/task")) > 1:  # a thread now would be copied half-way into a fork
        command = [sys.executable, "-m", "muon_dtensor.tools.testing", spec]
        procs = [
            subprocess.Popen(
                [*command, str(r), str(world_size), tmp],
                stderr=_log(tmp, r),
                preexec_fn=lambda: _die_with_parent(launcher),  # noqa: PLW1509 - one call, then exec
            )
            for r in range(world_size)
        ]
        sys.exit(max(p.wait() for p in procs))
    children = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank(spec, rank, world_size, tmp, launcher, _worker)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    os._exit(0)


def _rank(
    spec: str, rank: int, world_size: int, tmp: str, launcher: int, worker: Callable[..., None]
) -> None:
    """A forked rank: it never returns into the launcher's code, whatever happens."""
    try:
        _die_with_parent(launcher)
        if rank:
            log = _log(tmp, rank)
            os.dup2(log.fileno(), 2)
            log.close()
        worker(spec, rank, world_size, tmp)  # leaves with os._exit
    except BaseException:  # noqa: BLE001 - the rank's set-up failed: say why, then leave
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _log(tmp: str, rank: int) -> IO[bytes]:
    return open(Path(tmp, f"stderr{rank}"), "ab")  # noqa: SIM115 - inherited by the rank


def _die_with_parent(launcher: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # the launcher died before the line above
        os._exit(1)


if __name__ == "__main__":
    _launch(sys.argv[1], int(sys.argv[2]), sys.argv[3])
