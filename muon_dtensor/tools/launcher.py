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

__all__ = ["PRELOAD", "die_with_parent", "fork_ranks", "rank_stderr"]

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
                stderr=open(Path(tmp, f"stderr{r}"), "ab"),  # noqa: SIM115 - inherited by the rank
                preexec_fn=lambda: die_with_parent(launcher),  # noqa: PLW1509 - one call, then exec
            )
            for r in range(world_size)
        ]
        sys.exit(max(p.wait() for p in procs))

    def rank(r: int) -> int:
        rank_stderr(Path(tmp, f"stderr{r}"), r)
        _worker(spec, r, world_size, tmp)  # leaves with os._exit
        return 1

    for pid in fork_ranks(world_size, rank):
        os.waitpid(pid, 0)
    os._exit(0)


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


def rank_stderr(log: Path, rank: int) -> None:
    """Rank ``rank``'s stderr to ``log`` (appended); rank 0 keeps the launcher's, which is its log."""
    if rank:
        with open(log, "ab") as f:
            os.dup2(f.fileno(), 2)


def die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when ``parent`` dies, whatever it is blocked in."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


if __name__ == "__main__":
    _launch(sys.argv[1], int(sys.argv[2]), sys.argv[3])
