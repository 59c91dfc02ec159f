"""``run_ranks``: run a function on N local ranks in fresh processes, with a timeout, judged
through files. The tests, the benchmarks, the demo and the resume check launch their ranks with it.
On Linux, when the ranks use no GPU, they are forked from a launcher that imported torch once, and
this process keeps it for its next launch (``launcher.py``); otherwise each is an interpreter of its
own. Each rank (``rank.py``) runs the function and leaves its outcome in a file; the call judges
the files, not the exit codes. A rank that hangs is killed at the deadline and the test fails with
every rank's stderr.

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
from pathlib import Path
from typing import IO, Any

from .launcher import Launch, launch
from .rank import LOADING, FunctionRef, lookup

__all__ = ["RankError", "run_ranks"]

# Ranks one call may start on this host. Every rank is a whole Python process with torch (a few
# hundred MB) and a gloo connection to every other rank, and they all share this host's cores: 64
# still runs anywhere (slowly on a laptop), 8 per core on a larger host. Far beyond, the parent runs
# out of file descriptors or memory before the ranks meet.
MAX_LOCAL_RANKS = max(64, 8 * (os.cpu_count() or 1))
FIX = "define it with def at the top level of a module, e.g. myloop.py next to the script"
# False: one interpreter per rank even where the ranks could be forked (as on a GPU host); a test of
# that path sets it.
FORK = True
_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class RankError(RuntimeError):
    """A rank raised, hung or died; the message holds its traceback or every rank's stderr."""


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
        try:
            hung = _wait(procs, Path(tmp), timeout)
        except BaseException:  # Ctrl-C (KeyboardInterrupt) or another signal's error: end the ranks
            for p in procs:
                p.kill()
                p.wait()
            raise
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
    if LOADING:
        raise RuntimeError(
            f"{caller} was called while a rank imported {LOADING[0]} to find a function: each rank would "
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
    if lookup(sys.modules.get(module), qualname) is not fn:
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
        found = lookup(importlib.import_module(module), qualname)
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


def _start(
    spec: str, world_size: int, tmp: str, env: dict[str, str], logs: Sequence[IO[bytes]], fork: bool
) -> list[subprocess.Popen] | list[Launch]:
    """What to wait for: one launch by a launcher (``fork``: ``launcher.py``) or one process per
    rank, whose stderr goes to ``logs[rank]`` (forked ranks write their ``stderr<rank>`` themselves);
    stdout is dropped."""
    if fork:
        return [launch(spec, world_size, tmp, env)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "muon_dtensor.testing.rank", spec, str(rank), str(world_size), tmp],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=logs[rank],
        )  # fmt: skip
        for rank in range(world_size)
    ]


def _forks(env: dict[str, str]) -> bool:
    """Fork the ranks from one launcher: on Linux, where they see no GPU (no CUDA state to copy)."""
    return FORK and sys.platform == "linux" and env.get("CUDA_VISIBLE_DEVICES") == ""


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wait(procs: Sequence[subprocess.Popen | Launch], tmp: Path, timeout: float) -> bool:
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
