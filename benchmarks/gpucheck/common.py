"""What the parts of gpu_check share: settings, timers, comparisons and the part runner.

Times on CUDA are CUDA-event milliseconds after warmup; on CPU (the dry run) there are no CUDA
events, so a part that reports times uses ``time.perf_counter`` there and says so (``clock``).
"""

from __future__ import annotations

import signal
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Shape = tuple[int, int]

# Llama-3 matrices as (rows, cols) = (out, in) of nn.Linear: q/o, k/v (8 kv heads of 128), gate/up, down.
LLAMA_8B: dict[str, Shape] = {
    "8B q/o": (4096, 4096),
    "8B k/v": (1024, 4096),
    "8B gate/up": (14336, 4096),
    "8B down": (4096, 14336),
}
LLAMA_70B: dict[str, Shape] = {
    "70B q/o": (8192, 8192),
    "70B k/v": (1024, 8192),
    "70B gate/up": (28672, 8192),
    "70B down": (8192, 28672),
}
DRY_SHAPES: dict[str, Shape] = {"square": (64, 64), "wide": (32, 64), "tall": (64, 32)}


@dataclass(frozen=True)
class Dims:
    """A Llama layer's widths: model width, k/v rows, MLP width."""

    width: int
    kv: int
    ffn: int


LLAMA_8B_DIMS = Dims(4096, 1024, 14336)
DRY_DIMS = Dims(64, 32, 128)


@dataclass
class Settings:
    """Everything a run's size depends on; ``full`` for one H200, ``dry`` for a CPU dry run."""

    device: torch.device
    dry_run: bool
    budget_s: float
    a_shapes: dict[str, Shape]
    a_batches: tuple[int, ...]
    max_stack_bytes: int
    b_shapes: list[Shape]
    b_compile_shapes: list[Shape]
    peak_n: int
    reps: int
    warmup: int
    target_ms: float
    compile: bool
    layers: int
    dims: Dims
    step_reps: int
    lockstep: int
    reserve_s: float = 0.0  # seconds kept for the parts after the running one (part b's compiles)
    started: float = field(default_factory=time.perf_counter)
    trims: list[str] = field(default_factory=list)
    # part b's batch-1 rows: the step orthogonalizes one matrix per call where a matrix fills an
    # exchange round (4 MiB, DEFAULT_ROUND_BYTES; every Llama-3-8B weight is 8-112 MiB)
    b_one_shapes: list[Shape] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left_s(self) -> float:
        """Seconds of ``--budget-s`` left."""
        return self.budget_s - (time.perf_counter() - self.started)


class Skipped(Exception):  # noqa: N818 - a part's outcome, not an error
    """Raised by a part that cannot run here; its message is the reason."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], reps: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of ``reps`` calls after ``warmup`` untimed ones: CUDA events on CUDA, else
    ``time.perf_counter`` (the dry run)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def clock(device: torch.device) -> str:
    return "cuda events" if device.type == "cuda" else "perf_counter (no CUDA events on CPU)"


def compare(reference: torch.Tensor, other: torch.Tensor) -> dict[str, Any]:
    """Bitwise equal, and the largest absolute difference (in float32) where not."""
    if torch.equal(reference, other):
        return {"equal": True, "max_abs_diff": 0.0}
    diff = (reference.float() - other.float()).abs().max().item()
    return {"equal": False, "max_abs_diff": diff}


def error_text(exc: BaseException) -> str:
    """An exception's type, message and the last frames of its traceback."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines)
    return text if len(text) < 4000 else text[:1000] + "\n...\n" + text[-3000:]


class DeadlinePassed(BaseException):
    """``--budget-s`` ran out while a part ran. A BaseException: a part's per-case ``except
    Exception`` must not swallow it and go on to its next case."""


def _deadline(signum: int, frame: Any) -> None:
    raise DeadlinePassed("--budget-s ran out during this part")


def _alarm(seconds: float) -> bool:
    """Raise ``DeadlinePassed`` in the main thread after ``seconds`` (0: cancel); False where
    there is no interval timer (not POSIX, or not the main thread)."""
    if not hasattr(signal, "setitimer"):
        return False
    try:
        if seconds:
            signal.signal(signal.SIGALRM, _deadline)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    except ValueError:  # not the main thread
        return False
    return True


def run_part(name: str, fn: Callable[[Settings], dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Run one part within what is left of ``--budget-s``; never raises. ``status`` is ok,
    skipped (with ``reason``; also when the budget is spent before it starts) or error (with
    ``error``; also when the budget runs out during it); ``seconds`` its wall time."""
    if settings.left_s() <= 0:
        print(f"[{name}] skipped: --budget-s spent", flush=True)
        return {"status": "skipped", "reason": "--budget-s spent before this part", "seconds": 0.0}
    print(f"[{name}] running ({settings.left_s():.0f} s of budget left)", flush=True)
    start = time.perf_counter()
    timed = _alarm(max(settings.left_s(), 1e-3))
    try:
        entry: dict[str, Any] = {"status": "ok", "result": fn(settings)}
    except DeadlinePassed as late:
        entry = {"status": "error", "error": str(late)}
    except Skipped as why:
        entry = {"status": "skipped", "reason": str(why.args[0])}
        if why.args[1:]:
            entry["result"] = why.args[1]
    except Exception as exc:  # noqa: BLE001 - a failing part is a result; the others still run
        entry = {"status": "error", "error": error_text(exc)}
    finally:
        if timed:
            _alarm(0)
    if settings.cuda:
        torch.cuda.empty_cache()
    entry["seconds"] = round(time.perf_counter() - start, 2)
    print(f"[{name}] {entry['status']} in {entry['seconds']:.1f} s", flush=True)
    return entry


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
