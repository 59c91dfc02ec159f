"""A testing utility: run a function on N local ranks in fresh processes, with a timeout, judged
through files. The tests, the benchmarks, the demo and the resume check launch their ranks with it.
On Linux, when the ranks use no GPU, they are forked from one launcher that imported torch once
(``launcher.py``); otherwise each is an interpreter of its own.

Each rank runs the function and pickles ``("ok", value)`` or ``("error", traceback)`` to its own
file, then leaves with ``os._exit`` so no gloo destructor runs. gloo can abort a process at exit
("terminate called without an active exception") after all its work is done; since the parent
judges the files and not the exit codes, that cannot turn into a flaky failure. A rank that hangs
is killed at the deadline and the test fails with every rank's stderr.

The ranks find the function where the caller does (``function_ref``): the folder its module was
imported from and the caller's ``sys.path[0]`` (its script's folder) go first on their path; a
function of the caller's main script is found by running that script as the module ``__mp_main__``,
as multiprocessing's spawn does, so its ``if __name__ == "__main__":`` block does not run.
Lambdas, closures and nested functions are refused before any rank starts.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

__all__ = ["RankError", "run_ranks"]

# Ranks one call may start on this host. Every rank is a whole Python process with torch (a few
# hundred MB) and a gloo connection to every other rank, and they all share this host's cores: 64
# still runs anywhere (slowly on a laptop), 8 per core on a larger host. Far beyond, the parent runs
# out of file descriptors or memory before the ranks meet.
MAX_LOCAL_RANKS = max(64, 8 * (os.cpu_count() or 1))
FIX = "define it with def at the top level of a module, e.g. myloop.py next to the script"
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_LOADING: list[str] = []  # the module or script a rank is importing to find its function, meanwhile


class RankError(RuntimeError):
    """A rank raised, hung or died; the message holds its traceback or every rank's stderr."""


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


def run_ranks(fn: Callable[..., Any] | str, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Return each rank's return value; raise RankError with the failing rank's traceback. ``fn``: a
    module-level function or ``"module:function"``; ValueError / TypeError before any rank starts
    for one the ranks could not find, a world size above ``MAX_LOCAL_RANKS`` or a bad timeout."""
    ref = function_ref(fn, "fn", "run_ranks")
    check_launch(world_size, timeout, "world_size")
    # a rank killed at the deadline may still be writing while the folder goes: ignore that
    with tempfile.TemporaryDirectory(prefix="muon_dtensor_", ignore_cleanup_errors=True) as tmp:
        Path(tmp, "fn.pkl").write_bytes(pickle.dumps(ref))
        Path(tmp, "args.pkl").write_bytes(pickle.dumps(args))
        roots = [*ref.paths, _import_root(__name__), os.environ.get("PYTHONPATH")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, roots))}
        if _gpus() < world_size:  # one GPU per rank or none: NCCL cannot share a device
            env["CUDA_VISIBLE_DEVICES"] = ""
        logs = [open(Path(tmp, f"stderr{rank}"), "wb") for rank in range(world_size)]  # noqa: SIM115
        procs = _start(str(ref), world_size, tmp, env, logs, _forks(env))
        hung = _wait(procs, Path(tmp), timeout)
        for log in logs:
            log.close()
        if ref.script:  # values pickled in a rank name the script's classes as __mp_main__'s
            sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        return _judge(Path(tmp), world_size, hung, timeout)


def check_launch(world_size: Any, timeout: Any, name: str) -> None:
    """ValueError naming ``name`` or ``timeout`` unless 1 <= world size <= ``MAX_LOCAL_RANKS`` and the
    timeout is a positive, finite number of seconds."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{name} should be a positive int (ranks to start) but is {world_size!r}")
    if world_size > MAX_LOCAL_RANKS:
        raise ValueError(
            f"{name} {world_size:,} is above the limit of {MAX_LOCAL_RANKS} local ranks (max(64, 8 x this "
            f"host's {os.cpu_count()} CPUs): each is a process with torch): check on fewer ranks"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ValueError(
            f"timeout should be a positive, finite number of seconds (each launch's deadline) but is {timeout!r}"
        )


def function_ref(fn: Callable[..., Any] | str, name: str, caller: str) -> FunctionRef:
    """How the ranks find ``fn`` (a function or ``"module:function"``); TypeError / ValueError naming
    ``name`` and the fix, before any rank starts, for a function they could not find."""
    if _LOADING:
        raise RuntimeError(
            f"{caller} was called while a rank imported {_LOADING[0]} to find a function: each rank would "
            f'launch again; put the call under `if __name__ == "__main__":`'
        )
    if isinstance(fn, str):
        fn = _import_spec(fn, name)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if (
        not callable(fn)
        or inspect.ismethod(fn)
        or not isinstance(module, str)
        or not isinstance(qualname, str)
    ):
        raise TypeError(f"{name} should be a module-level function (ranks import it) but is {fn!r}: {FIX}")
    if "<" in qualname:
        kind = (
            "a lambda"
            if "<lambda>" in qualname
            else "defined inside a function (a closure or nested function)"
        )
        raise TypeError(
            f"{name} should be a module-level function (ranks import it) but {qualname} is {kind}: {FIX}, and "
            f'pass it (or "myloop:{fn.__name__}")'
        )
    if module == "__main__":
        return _script_ref(fn, name, caller)
    if _lookup(sys.modules.get(module), qualname) is not fn:
        raise TypeError(
            f"{name} {fn!r} is not {module}:{qualname} (a decorator without functools.wraps?): {FIX}"
        )
    return FunctionRef(module, qualname, _paths(_import_root(module)))


def _import_spec(text: str, name: str) -> Any:
    """The function ``"module:function"`` names, imported here as the ranks will import it."""
    if not _SPEC.fullmatch(text):
        raise ValueError(
            f'{name} should be a function or "module:function" (e.g. "myloop:{name}") but is {text!r}'
        )
    module, qualname = text.split(":")
    try:
        found = _lookup(importlib.import_module(module), qualname)
    except ImportError as e:
        raise ValueError(
            f"{name}={text!r}: cannot import {module!r} ({e}); the ranks look in {sys.path[0] or os.getcwd()!r} "
            f"(the script's folder) and on PYTHONPATH: put {module.split('.')[0]} there"
        ) from None
    if found is None:
        raise ValueError(f"{name}={text!r}: module {module!r} has no {qualname!r}")
    return found


def _import_root(module: str) -> str | None:
    """The folder ``module`` was imported from (None for one with no file), so the ranks import the same code."""
    found = sys.modules.get(module)
    file = getattr(found, "__file__", None)
    if not file:
        return None
    name = getattr(getattr(found, "__spec__", None), "name", None) or module  # __main__ run with -m
    depth = name.count(".") + (Path(file).name == "__init__.py")
    return str(Path(file).resolve().parents[depth])


def _paths(*roots: str | None) -> tuple[str, ...]:
    """``roots`` and the caller's ``sys.path[0]`` (its script's folder, or the working folder), in order."""
    first = os.path.abspath(sys.path[0]) if sys.path and os.path.isdir(sys.path[0] or ".") else None
    return tuple(dict.fromkeys(p for p in (*roots, first) if p))


def _lookup(module: ModuleType | None, qualname: str) -> Any:
    """``module``'s attribute ``qualname`` (dotted: a class's function), or None."""
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


def _script_ref(fn: Callable[..., Any], name: str, caller: str) -> FunctionRef:
    """A function of the caller's main script: the ranks run the script as a module (``python -m
    pkg.script``: they import ``pkg.script``), which must keep ``caller`` under its main guard."""
    main = sys.modules["__main__"]
    file, spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if not file or not os.path.isfile(file):
        raise TypeError(
            f"{name} is defined in __main__ with no script file (an interactive session or a notebook), "
            f"which the ranks cannot import: move build and train_step into a module, e.g. myloop.py, and "
            "pass myloop.build, myloop.train_step"
        )
    _check_guarded(Path(file), name, caller)
    if spec is not None and spec.name not in ("__main__", None):
        return FunctionRef(spec.name, fn.__qualname__, _paths(_import_root("__main__")))
    script = str(Path(file).resolve())
    return FunctionRef("__main__", fn.__qualname__, _paths(str(Path(script).parent)), script)


def _check_guarded(script: Path, name: str, caller: str) -> None:
    """ValueError when the script calls ``caller`` outside ``if __name__ == "__main__":``: each rank
    runs the script to find ``name``, so each would launch again."""
    line = _script_line()
    try:
        tree = ast.parse(script.read_text())
    except (OSError, SyntaxError, ValueError):
        return
    guards = [n for n in tree.body if isinstance(n, ast.If) and _is_main_guard(n.test)]
    if line is None or any(g.lineno <= line <= (g.end_lineno or g.lineno) for g in guards):
        return
    raise ValueError(
        f"{name} is defined in {script.name}, which each rank runs to find it, and {caller} is called at "
        f'line {line} outside `if __name__ == "__main__":`, so every rank would start it again: put the '
        "call under that guard, or move build and train_step into a module, e.g. myloop.py next to the script"
    )


def _script_line() -> int | None:
    """The line of the caller's main script (its top level) running now."""
    main = sys.modules["__main__"].__dict__
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is main and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    return frame.f_lineno if frame is not None else None


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def resolve(ref: FunctionRef) -> Callable[..., Any]:
    """The function ``ref`` names, in this rank: ``ref.paths`` go first on ``sys.path``; a script's
    function comes from the script run as ``__mp_main__`` (also registered as ``__main__``)."""
    for path in reversed(ref.paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    _LOADING.append(ref.script or ref.module)  # a launch while it loads is refused (function_ref)
    try:
        module = _run_script(ref.script) if ref.script else importlib.import_module(ref.module)
    finally:
        _LOADING.pop()
    found = _lookup(module, ref.qualname)
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


def _start(
    spec: str, world_size: int, tmp: str, env: dict[str, str], logs: Sequence[IO[bytes]], fork: bool
) -> list[subprocess.Popen]:
    """The processes to wait for: one launcher (``fork``: ``launcher.py``) or one per rank. Rank r's
    stderr goes to ``logs[r]``; stdout is dropped."""

    def rank_command(rank: int) -> list[str]:
        return [sys.executable, "-m", "muon_dtensor.tools.testing", spec, str(rank), str(world_size), tmp]

    if fork:
        command = [sys.executable, "-m", "muon_dtensor.tools.launcher", spec, str(world_size), tmp]
        return [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=logs[0])]
    return [
        subprocess.Popen(rank_command(rank), env=env, stdout=subprocess.DEVNULL, stderr=logs[rank])
        for rank in range(world_size)
    ]


def _forks(env: dict[str, str]) -> bool:
    """Fork the ranks from one launcher: on Linux, where they see no GPU (no CUDA state to copy)."""
    return sys.platform == "linux" and env.get("CUDA_VISIBLE_DEVICES") == ""


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
    """Rank ``rank``'s process: ``spec`` (``module:function``) only names the function for ``ps``."""
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


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
