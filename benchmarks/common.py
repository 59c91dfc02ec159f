"""What the benchmark scripts share: matrix sets, traffic formulas, machine facts and load.

Run the scripts from the repository root; they put it on ``sys.path`` and import this module as
``benchmarks.common``.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from muon_dtensor.demo.cpu import host_cpu
from muon_dtensor.planning.costmodel import transformer_shapes

ROOT = Path(__file__).resolve().parent.parent
BF16_BYTES = 2

# name -> what it is; shapes come from ``set_shapes``.
MATRIX_SETS = {
    "default": "--layers layers of width --width: q, k, v, o (w x w), MLP up (4w x w), down (w x 4w)",
    # GPT-2 small is 12 layers of width 768 with a fused qkv (2304 x 768) and a 4x MLP (no gate);
    # scaled to 4 layers of width 384 so one step takes about a third of a second here.
    "gpt2": "GPT-2-like, 4 layers of width 384: qkv fused (1152 x 384), o, MLP up (1536 x 384), down",
    # Llama-3 has 8 kv heads and a gated MLP of ~3.5x width; scaled: dim 512, kv 128 rows, ffn 1408.
    "llama": "Llama-like, 4 layers of dim 512: q, o (512^2), k, v (128 x 512), gate, up (1408 x 512), down",
}


def set_shapes(name: str, layers: int = 8, width: int = 512) -> list[tuple[int, int]]:
    """The matrices (rows x cols = out x in) of matrix set ``name``."""
    if name == "default":
        return transformer_shapes(layers, width)
    if name == "gpt2":
        return transformer_shapes(4, 384, fused_qkv=True)
    if name == "llama":
        return transformer_shapes(4, 512, kv_rows=128, ffn=1408, gated=True)
    raise ValueError(f"matrix set must be one of {sorted(MATRIX_SETS)} but is: {name!r}")


def comm_formulas(shapes: list[tuple[int, int]], n: int) -> dict[str, float]:
    """S (all matrices in bf16) and the bytes each rank should send per step, each rank holding 1/N
    of every matrix: owner 2 S (N-1) / N^2 (blocks to their owner and back), gather S (N-1) / N."""
    s = sum(r * c for r, c in shapes) * BF16_BYTES
    return {"S": s, "owner": 2 * s * (n - 1) / n**2, "gather": s * (n - 1) / n}


def percent_off(measured: float, expected: float) -> float:
    """(measured - expected) / expected in percent; 0 when both are 0."""
    if expected == 0:
        return 0.0 if measured == 0 else float("inf")
    return 100.0 * (measured - expected) / expected


def other_python_processes() -> int:
    """Python processes on this machine that are not this one or its children (other sessions' tests)."""
    try:
        out = subprocess.run(
            ["ps", "-eo", "pid,ppid,comm"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return -1
    me = os.getpid()
    count = 0
    for line in out.splitlines()[1:]:
        pid, ppid, comm = line.split(None, 2)
        if "python" in comm and int(pid) != me and int(ppid) != me:
            count += 1
    return count


def load_snapshot() -> dict[str, Any]:
    """Load average and other Python processes now; timings taken under load are noisier."""
    return {"loadavg_1_5_15_min": os.getloadavg(), "other_python_processes": other_python_processes()}


def wait_for_quiet(timeout: float, max_load: float = 1.0, poll: float = 5.0) -> dict[str, Any]:
    """Wait up to ``timeout`` seconds for no other Python process and a 1-minute load below
    ``max_load`` (other sessions run tests on the same cores); the snapshot it stopped at."""
    start = time.monotonic()
    snap = load_snapshot()
    while time.monotonic() - start < timeout:
        if snap["other_python_processes"] == 0 and snap["loadavg_1_5_15_min"][0] < max_load:
            break
        time.sleep(poll)
        snap = load_snapshot()
    return snap | {"waited_s": round(time.monotonic() - start, 1)}


def system_info() -> dict[str, Any]:
    cpu, _ = host_cpu()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1_5_15_min_at_end": os.getloadavg(),
    }


def alternate_timed_steps(opts: dict[str, Any], steps: int, warmup: int) -> dict[str, list[float]]:
    """Inside a rank: ``warmup`` untimed steps of each optimizer (then its ``comm_stats`` reset),
    then ``steps`` rounds of one barrier-started, timed step each, so a change in the machine's load
    touches every contender alike. Seconds per step, per label."""
    import torch.distributed as dist

    for opt in opts.values():
        for _ in range(warmup):
            opt.step()
        opt.comm_stats.reset()
    times: dict[str, list[float]] = {label: [] for label in opts}
    for _ in range(steps):
        for label, opt in opts.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            times[label].append(time.perf_counter() - start)
    return times


def slowest_rank_steps(per_rank: list[dict[str, Any]], label: str) -> list[float]:
    """Each timed step's time on its slowest rank, from every rank's ``[label]["times"]``."""
    return [max(t) for t in zip(*(r[label]["times"] for r in per_rank), strict=True)]


def results_config(args: Any) -> dict[str, Any]:
    """A script's arguments for its results file, ``--out`` relative to the repository (no machine
    paths in the results)."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if args.out.resolve().is_relative_to(ROOT):
        config["out"] = str(args.out.resolve().relative_to(ROOT))
    return config


def least_cpu_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The least process time of ``repeat`` calls of ``fn`` (other work on the host does not count)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best
