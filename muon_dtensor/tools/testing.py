"""A testing utility: run a function on N local ranks in fresh processes, with a timeout, judged
through files. The tests, the benchmarks and the demo launch their ranks with it.

Each rank runs ``module:function(*args)`` and pickles ``("ok", value)`` or ``("error", traceback)``
to its own file, then leaves with ``os._exit`` so no gloo destructor runs. gloo can abort a process
at exit ("terminate called without an active exception") after all its work is done; since the
parent judges the files and not the exit codes, that cannot turn into a flaky failure. A rank that
hangs is killed at the deadline and the test fails with every rank's stderr.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """A rank raised, hung or died; the message holds its traceback or every rank's stderr."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Return each rank's return value; raise RankError with the failing rank's traceback."""
    spec = f"{fn.__module__}:{fn.__qualname__}"
    with tempfile.TemporaryDirectory(prefix="muon_dtensor_") as tmp:
        Path(tmp, "args.pkl").write_bytes(pickle.dumps(args))
        roots = [_import_root(fn.__module__), _import_root(__name__), os.environ.get("PYTHONPATH")]
        path = os.pathsep.join(filter(None, roots))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        if _gpus() < world_size:  # one GPU per rank or none: NCCL cannot share a device
            env["CUDA_VISIBLE_DEVICES"] = ""
        logs = [open(Path(tmp, f"stderr{rank}"), "wb") for rank in range(world_size)]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "muon_dtensor.tools.testing", spec, str(rank), str(world_size), tmp],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=logs[rank],
            )
            for rank in range(world_size)
        ]
        hung = _wait(procs, Path(tmp), timeout)
        for log in logs:
            log.close()
        return _judge(Path(tmp), world_size, hung, timeout)


def _import_root(module: str) -> str:
    """The folder ``module`` was imported from, so the ranks import the same code."""
    file = sys.modules[module].__file__
    assert file is not None
    depth = module.count(".") + (Path(file).name == "__init__.py")
    return str(Path(file).resolve().parents[depth])


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wait(procs: list[subprocess.Popen], tmp: Path, timeout: float) -> bool:
    """Wait for every rank; True if some rank had to be killed. Once a rank has reported an error,
    the others get a short grace period: they are likely stuck in a collective it never joined."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            return True
        if any(_status(f) == "error" for f in tmp.glob("result*.pkl")):
            deadline = min(deadline, time.monotonic() + 15.0)
        time.sleep(0.05)
    return False


def _status(path: Path) -> str:
    return pickle.loads(path.read_bytes())[0]


def _stderr(tmp: Path, ranks: list[int]) -> str:
    return "\n".join(
        f"--- rank {r} stderr ---\n{(tmp / f'stderr{r}').read_text(errors='replace')[-3000:]}" for r in ranks
    )


def _judge(tmp: Path, world_size: int, hung: bool, timeout: float) -> list[Any]:
    silent = [r for r in range(world_size) if not (tmp / f"result{r}.pkl").exists()]
    errors = {}
    for path in sorted(tmp.glob("result*.pkl")):
        status, value = pickle.loads(path.read_bytes())
        if status == "error":
            errors[path.stem] = value
    if errors:
        # A rank's own error first; "Connection reset" is usually another rank's consequence.
        first = min(errors, key=lambda k: ("Connection reset" in errors[k], k))
        rest = "".join(
            f"\n--- also {k}: {v.strip().splitlines()[-1]}" for k, v in errors.items() if k != first
        )
        others = f"\nranks without a result: {silent}\n{_stderr(tmp, silent)}" if silent else ""
        raise RankError(f"{first} failed{' (others hung)' if hung else ''}:\n{errors[first]}{rest}{others}")
    if silent:
        why = f"timed out after {timeout:.0f} s (hang?)" if hung else "exited without a result"
        raise RankError(f"rank {silent[0]} {why}\n{_stderr(tmp, list(range(world_size)))}")
    return [pickle.loads((tmp / f"result{r}.pkl").read_bytes())[1] for r in range(world_size)]


def _worker(spec: str, rank: int, world_size: int, tmp: str) -> None:
    import importlib
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
        module, name = spec.split(":")
        fn = getattr(importlib.import_module(module), name)
        args = pickle.loads(Path(tmp, "args.pkl").read_bytes())
        outcome = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - report every failure, CheckpointException included
        outcome = ("error", traceback.format_exc())
    part = Path(tmp, f"result{rank}.pkl.part")
    part.write_bytes(pickle.dumps(outcome))
    part.rename(Path(tmp, f"result{rank}.pkl"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
