"""What runs in a rank that ``run_ranks`` started: find the function where the caller did
(``resolve``), join the gloo (or NCCL) group, run it, and leave its outcome in a file.

Each rank pickles ``("ok", value)`` or ``("error", traceback)`` to its own file, then leaves with
``os._exit`` so no gloo destructor runs. gloo can abort a process at exit ("terminate called without
an active exception") after all its work is done; since the caller judges the files and not the exit
codes, that cannot turn into a flaky failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["LOADING", "FunctionRef", "join", "lookup", "resolve", "worker"]

LOADING: list[str] = []  # the module or script a rank is importing to find its function, meanwhile


@dataclass(frozen=True)
class FunctionRef:
    """Where a rank finds a function: ``module:qualname`` with ``paths`` first on ``sys.path``;
    ``script``: the caller's main script, which holds it (run in the rank as ``__mp_main__``)."""

    module: str
    qualname: str
    paths: tuple[str, ...] = ()
    script: str | None = None

    def __str__(self) -> str:
        return f"{self.module}:{self.qualname}"


def lookup(module: ModuleType | None, qualname: str) -> Any:
    """``module``'s attribute ``qualname`` (dotted: a class's function), or None."""
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def resolve(ref: FunctionRef) -> Callable[..., Any]:
    """The function ``ref`` names, in this rank: ``ref.paths`` go first on ``sys.path``; a script's
    function comes from the script run as ``__mp_main__`` (also registered as ``__main__``)."""
    for path in reversed(ref.paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    LOADING.append(ref.script or ref.module)  # a launch while it loads is refused (function_ref)
    try:
        module = _run_script(ref.script) if ref.script else importlib.import_module(ref.module)
    finally:
        LOADING.pop()
    found = lookup(module, ref.qualname)
    if not callable(found):
        raise AttributeError(f"{ref}: {module.__name__} ({module.__file__}) has no function {ref.qualname!r}")
    return found


def _run_script(path: str) -> ModuleType:
    """The caller's script as the module ``__mp_main__``, once per process (its main guard is False)."""
    loaded = sys.modules.get("__mp_main__")
    if loaded is not None and getattr(loaded, "__file__", None) == path:
        return loaded
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["__mp_main__"]
        raise
    sys.modules["__main__"] = module  # what the caller's __main__ pickled (its classes) loads from here
    return module


def worker(spec: str, rank: int, world_size: int, tmp: str) -> None:
    """Rank ``rank``'s process: ``spec`` (``module:function``) only names the function for ``ps``."""
    import faulthandler
    import traceback

    import torch
    import torch.distributed as dist

    _stdin_devnull()  # not the launcher's request pipe, nor the caller's terminal
    faulthandler.enable(all_threads=True)  # a crash in native code leaves its Python stacks in the log
    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        join(dist, rank, world_size, tmp)
        fn = resolve(pickle.loads(Path(tmp, "fn.pkl").read_bytes()))  # first: args may need its module
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


def join(dist: ModuleType, rank: int, world_size: int, tmp: str) -> None:
    """Join the world's default group, then wait until every rank has joined: a rank whose function
    does not communicate would otherwise leave while a slower peer's gloo still waits for its side
    of the connection, and that peer's init fails with "Connection closed by peer" (gloo's
    ``Pair::waitUntilConnected`` throws the error its loop thread saw first; CI, stop 53)."""
    import torch

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
    dist.all_reduce(torch.zeros(1))  # a host tensor: gloo's, even beside NCCL (a barrier may pick NCCL)


def _stdin_devnull() -> None:
    """This process's stdin (descriptor 0 and ``sys.stdin``, whose buffer may hold requests a launcher
    had read ahead) becomes /dev/null."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin for its lifetime


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
