"""Time one Muon optimizer step, side by side, on a transformer-shaped set of matrices.

Contenders, all stepping the same seeded gradients (set once, stepped repeatedly):

1. ``torch.optim.Muon`` on plain tensors in one process (the baseline, ratio 1.00);
2. ``muon_dtensor.Muon`` on plain tensors in one process (its single-process cost);
3. ``torch.optim.Muon`` on FSDP2-style DTensors (``Shard(0)`` on a 1-D gloo mesh of N ranks);
4. ``muon_dtensor.Muon(mode="gather")`` on the same DTensors;
5. ``muon_dtensor.Muon(mode="owner")`` on the same DTensors.

The matrix set is ``--layers`` transformer layers of width ``--width``: per layer q, k, v, o
of width x width, MLP up of 4*width x width and MLP down of width x 4*width (rows x cols =
out x in, as ``nn.Linear(in, out).weight``). Every process uses one torch thread and
``OMP_NUM_THREADS=1``. Ranks run in fresh processes (gloo, ``file://`` init), barrier before
each timed step; a step's time is the slowest rank's, and the table shows the median step.

Examples, from the repository root::

    python benchmarks/bench_step.py
    python benchmarks/bench_step.py --layers 4 --width 256
    python benchmarks/bench_step.py --world-size 2 --steps 10 --warmup 3 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import os
import pickle
import platform
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_step.json"
BF16_BYTES = 2
SEED = 0
# (table label, optimizer kind for build_optimizer)
SINGLE = [
    ("torch.optim.Muon (plain tensors)", "torch"),
    ("muon_dtensor.Muon (plain tensors)", "owner"),
]
DISTRIBUTED = [
    ("torch.optim.Muon (DTensor)", "torch"),
    ('muon_dtensor.Muon mode="gather"', "gather"),
    ('muon_dtensor.Muon mode="owner"', "owner"),
]
OWNER_TARGET = 0.6


# --------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="transformer layers (8)")
    p.add_argument("--width", type=int, default=512, help="model width (512)")
    p.add_argument("--steps", type=int, default=7, help="timed steps (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (2)")
    p.add_argument("--timeout", type=float, default=900.0, help="rank timeout, s")
    p.add_argument("--profile", action="store_true", help="cProfile an owner step")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-dir", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def matrix_shapes(layers: int, width: int) -> list[tuple[int, int]]:
    """q, k, v, o, MLP up (4w x w) and MLP down (w x 4w) per layer, rows x cols."""
    per_layer = [(width, width)] * 4 + [(4 * width, width), (width, 4 * width)]
    return per_layer * layers


def make_tensors(
    shapes: list[tuple[int, int]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Seeded full parameters and gradients; every process builds the same ones."""
    gen = torch.Generator().manual_seed(SEED)
    params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    return params, grads


def build_optimizer(kind: str, params: list[nn.Parameter]) -> Optimizer:
    """``torch``: torch.optim.Muon; ``owner``/``gather``: muon_dtensor.Muon in that mode."""
    if kind == "torch":
        return torch.optim.Muon(params, lr=0.02)
    sys.path.insert(0, str(ROOT))
    from muon_dtensor import Muon

    return Muon(params, lr=0.02, mode=kind)


# --------------------------------------------------------------------------- timing
def time_steps(opt: Optimizer, warmup: int, steps: int, barrier: bool) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones."""
    import torch.distributed as dist

    for _ in range(warmup):
        opt.step()
    stats = getattr(opt, "comm_stats", None)
    if stats is not None:
        stats.reset()
    times = []
    for _ in range(steps):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def measure(
    kind: str,
    params: list[nn.Parameter],
    args: argparse.Namespace,
    barrier: bool,
) -> dict[str, Any]:
    """Time ``kind`` on ``params`` (grads already set); step times and bytes sent."""
    opt = build_optimizer(kind, params)
    times = time_steps(opt, args.warmup, args.steps, barrier)
    stats = getattr(opt, "comm_stats", None)
    sent = None if stats is None else stats.sent / args.steps
    return {"times": times, "sent": sent}


def single_process(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time ``kind`` on plain tensors in this process."""
    fulls, grads = make_tensors(matrix_shapes(args.layers, args.width))
    params = [nn.Parameter(f) for f in fulls]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return measure(kind, params, args, barrier=False)


def profile_owner_step(opt: Optimizer, top: int = 25) -> str:
    """cProfile of one more step of ``opt``, top functions by own time."""
    import torch.distributed as dist

    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    opt.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# --------------------------------------------------------------------------- ranks
def rank_contenders(args: argparse.Namespace) -> dict[str, Any]:
    """Inside a rank: time every distributed contender on fresh Shard(0) DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (args.world_size,))
    fulls, grads = make_tensors(matrix_shapes(args.layers, args.width))
    out: dict[str, Any] = {}
    for label, kind in DISTRIBUTED:
        params = [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
        for p, g in zip(params, grads, strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        out[label] = measure(kind, params, args, barrier=True)
    if args.profile:
        opt = build_optimizer("owner", params)
        opt.step()
        out["profile"] = profile_owner_step(opt)
    return out


def worker(args: argparse.Namespace) -> None:
    """Entry of a rank process: results to a file, then ``os._exit`` (gloo may abort at exit)."""
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, tmp = args.worker_rank, args.worker_dir
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=args.world_size,
        )
        outcome: tuple[str, Any] = ("ok", rank_contenders(args))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        outcome = ("error", traceback.format_exc())
    part = tmp / f"result{rank}.pkl.part"
    part.write_bytes(pickle.dumps(outcome))
    part.rename(tmp / f"result{rank}.pkl")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``world_size`` rank processes; each rank's result dict, in rank order."""
    with tempfile.TemporaryDirectory(prefix="bench_step_") as name:
        tmp = Path(name)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        base = [sys.executable, str(Path(__file__).resolve()), *_forwarded(args)]
        with contextlib.ExitStack() as files:
            procs = [
                subprocess.Popen(
                    [*base, "--worker-rank", str(r), "--worker-dir", name],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=files.enter_context(open(tmp / f"stderr{r}", "wb")),
                )
                for r in range(args.world_size)
            ]
            _wait(procs, args.timeout)
        return [_read_result(tmp, r) for r in range(args.world_size)]


def _forwarded(args: argparse.Namespace) -> list[str]:
    flags = ["--layers", str(args.layers), "--width", str(args.width)]
    flags += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    flags += ["--world-size", str(args.world_size)]
    return flags + (["--profile"] if args.profile else [])


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
                p.wait()
            return
        time.sleep(0.1)


def _read_result(tmp: Path, rank: int) -> dict[str, Any]:
    path = tmp / f"result{rank}.pkl"
    if not path.exists():
        stderr = (tmp / f"stderr{rank}").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"rank {rank} left no result (timeout?):\n{stderr}")
    status, value = pickle.loads(path.read_bytes())
    if status != "ok":
        raise RuntimeError(f"rank {rank} failed:\n{value}")
    return value


# --------------------------------------------------------------------------- report
def summarize(
    label: str, ranks: int, per_rank: list[dict[str, Any]], base_ms: float | None
) -> dict[str, Any]:
    """Median over steps of the slowest rank's step time; bytes: most any rank sent."""
    slowest = [max(steps) for steps in zip(*(r["times"] for r in per_rank), strict=True)]
    median_ms = statistics.median(slowest) * 1e3
    sent = [r["sent"] for r in per_rank]
    return {
        "contender": label,
        "ranks": ranks,
        "median_ms": median_ms,
        "ratio": median_ms / base_ms if base_ms else 1.0,
        "bytes_sent_per_rank_per_step": None if sent[0] is None else max(sent),
        "bytes_sent_each_rank": sent,
        "step_ms_slowest_rank": [t * 1e3 for t in slowest],
    }


def comm_formulas(shapes: list[tuple[int, int]], n: int) -> dict[str, float]:
    """S (all matrices in bf16) and the expected bytes sent per rank per step."""
    s = sum(r * c for r, c in shapes) * BF16_BYTES
    return {"S": s, "owner": 2 * s * (n - 1) / n**2, "gather": s * (n - 1) / n}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        (
            "| contender | ranks | median step ms "
            "| ratio to torch.optim.Muon one-process | bytes sent/rank/step |"
        ),
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        sent = r["bytes_sent_per_rank_per_step"]
        sent_text = "n/a" if sent is None else f"{sent:,.0f}"
        lines.append(
            f"| {r['contender']} | {r['ranks']} | {r['median_ms']:.1f} | {r['ratio']:.2f} | {sent_text} |"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    by = {r["contender"]: r for r in rows}
    owner = by[DISTRIBUTED[2][0]]
    return {
        f"owner ratio <= {OWNER_TARGET}": owner["ratio"] <= OWNER_TARGET,
        "owner faster than torch.optim.Muon on DTensors": owner["median_ms"]
        < by[DISTRIBUTED[0][0]]["median_ms"],
    }


def system_info() -> dict[str, Any]:
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1_5_15_min_at_end": os.getloadavg(),
    }


# --------------------------------------------------------------------------- main
def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every contender, baseline first; the rows of the table."""
    torch.set_num_threads(1)
    base = single_process(SINGLE[0][1], args)
    base_ms = summarize(SINGLE[0][0], 1, [base], None)["median_ms"]
    rows = [summarize(SINGLE[0][0], 1, [base], base_ms)]
    rows.append(summarize(SINGLE[1][0], 1, [single_process(SINGLE[1][1], args)], base_ms))
    per_rank = spawn_ranks(args)
    for label, _ in DISTRIBUTED:
        results = [r[label] for r in per_rank]
        rows.append(summarize(label, args.world_size, results, base_ms))
    if args.profile:
        print("cProfile of one owner-mode step on rank 0:\n" + per_rank[0]["profile"])
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    shapes = matrix_shapes(args.layers, args.width)
    formulas = comm_formulas(shapes, args.world_size)
    targets = check_targets(rows)
    print(format_table(rows))
    print()
    n = args.world_size
    print(
        f"S = {formulas['S']:,.0f} bytes ({len(shapes)} matrices in bf16); "
        f"owner 2*S*(N-1)/N^2 = {formulas['owner']:,.0f}; "
        f"gather S*(N-1)/N = {formulas['gather']:,.0f} (N = {n})"
    )
    verdict = "PASS" if all(targets.values()) else "FAIL"
    print(f"{verdict}: " + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in targets.items()))
    config = {k: v for k, v in vars(args).items() if not k.startswith("worker")}
    config["out"] = str(config["out"])
    payload = {**system_info(), "config": config, "num_matrices": len(shapes)}
    payload |= {"comm_formulas": formulas, "rows": rows, "targets": targets}
    payload["verdict"] = verdict
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    load = payload["loadavg_1_5_15_min_at_end"]
    print(f"load average at end (1, 5, 15 min): {load}")
    print(f"results written to {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker_rank is not None:
        worker(args)
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    report(args, run_all(args))


if __name__ == "__main__":
    main()
