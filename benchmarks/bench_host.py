"""Host work per optimizer step: top-level ops, collectives and host time, Muon against AdamW.

Models of tiny width (16), so the step's matrix products cost next to nothing and what is left is
the host's work: dispatching ops and issuing collectives. Each model is L or 2L Llama-shaped layers
(q, o 16 x 16; GQA k, v 8 x 16; gate, up 48 x 16; down 16 x 48, all ``nn.Linear`` without bias;
two RMSNorm weights), an embedding and a head, ``fully_shard`` per layer and on the root, on 2 and
4 gloo ranks with one torch thread each. Contenders on the same DTensor model, with the same seeded
gradients:

1. ``Muon(split_params(model, adamw_options=...))`` with ``MUON_DTENSOR_NS_BATCH=never`` (the CPU
   path: Newton-Schulz one matrix at a time);
2. the same optimizer with ``always`` (the batching of the CUDA path: same-shape matrices as one
   batched product);
3. ``torch.optim.AdamW(foreach=True)`` on every parameter.

After 2 warm-up steps per contender, one step under ``torch.profiler`` counts the top-level ``aten::``
ops (no ``aten::`` or ``c10d::`` op among their ancestors; the optimizer's own ``record_function``
scope does not count as a parent) and the collectives (top-level ``c10d::`` ops, each once; gloo's
worker-thread events for the same collective are not counted again), on the rank with the most ops.
Host time: timed steps alternate between the contenders, each after a barrier; a step's time is
its slowest rank's, the table shows the median. "ops added per layer" is (ops(2L) - ops(L)) / L.
Second case: up to 1,000 matrices of 16 x 16 (250 layers of 4), 2 ranks: host time against AdamW,
and each contender's first step (state, plan and DTensor's sharding-propagation caches are built
then); not counted, since the profiler takes tens of seconds to list that many events. AdamW's
first step on DTensors grows with the square of the matrices and swings with the machine's load
(docs/benchmarks.md, "Host work per step"), so a probe at 160 matrices picks the most that fit
``--budget`` (270 s for the whole run); the output says what it picked.

Run from the repository root (under 5 minutes on a 2-core machine)::

    python benchmarks/bench_host.py
    python benchmarks/bench_host.py --layers 4 --steps 5 --many-layers 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import results_config, system_info, wait_for_quiet  # noqa: E402
from benchmarks.host_stats import format_depth, format_timed, per_layer, rotated, summarize  # noqa: E402
from muon_dtensor.base.op_count import top_level_ops  # noqa: E402
from muon_dtensor.demo.cpu import host_cpu  # noqa: E402
from muon_dtensor.numerics.newton_schulz import BATCH_ENV  # noqa: E402

WIDTH, KV, FFN, VOCAB = 16, 8, 48, 64
ADAMW_OPTIONS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
# label -> (optimizer, MUON_DTENSOR_NS_BATCH while it steps)
CONTENDERS = {
    "muon_dtensor, CPU path (never)": ("muon", "never"),
    "muon_dtensor, CUDA batching (always)": ("muon", "always"),
    "torch AdamW foreach": ("adamw", "never"),
}
ADAMW = list(CONTENDERS)[-1]
PROBE_LAYERS = 40  # the many-matrices case's probe: 160 matrices
# Plan the case for half the time left: on a shared machine the load moves between the probe and
# the case, and the square law from a small probe misses either way.
USABLE = 0.5
START_UP_S = 20.0  # 2 rank processes importing torch and meeting, on a busy 2-core machine
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_host.json"


class LlamaLayer(nn.Module):
    """The Llama-shaped layer at ``width`` (GQA k, v at half of it, the MLP at three times it)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        kv, ffn = width * KV // WIDTH, width * FFN // WIDTH
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.q, self.o = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.k, self.v = nn.Linear(width, kv, bias=False), nn.Linear(width, kv, bias=False)
        self.gate, self.up = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)


class SquareLayer(nn.Module):  # four 16 x 16 matrices, for the many-matrices case
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))


class DefaultLayer(nn.Module):
    """``bench_step.py``'s default set at ``width``: q, k, v, o (w x w), MLP up (4w x w), down (w x 4w)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)


LAYERS = {"llama": LlamaLayer, "default": DefaultLayer}


class Model(nn.Module):
    def __init__(self, layers: list[nn.Module], width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)


def sharded_model(layers: int, kind: str = "llama", width: int = WIDTH) -> nn.Module:
    """Inside a rank: a seeded model (``kind``'s layers at ``width``), ``fully_shard`` per layer and on
    the root, seeded gradients laid out as FSDP2 lays them out (``fsdp_grad``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model([LAYERS[kind](width) if kind in LAYERS else SquareLayer() for _ in range(layers)], width)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = fsdp_grad(p)
    return model


def fsdp_grad(p: Any) -> Any:
    """A seeded gradient built as FSDP2's reduce-scatter builds one: on the parameter's own
    DTensor spec (``randn_like`` would make a new spec, which the step's checks then compare in
    full, parameter by parameter, as they must for a gradient of unknown layout)."""
    from torch.distributed.tensor import DTensor

    return DTensor(torch.randn(p._local_tensor.shape), p._spec, requires_grad=False)


def optimizers(model: nn.Module, **muon_options: Any) -> dict[str, torch.optim.Optimizer]:
    """Muon (with ``muon_options``) on the matrices and AdamW on the rest, and AdamW on all."""
    from muon_dtensor import Muon, split_params

    muon = Muon(split_params(model, adamw_options=dict(ADAMW_OPTIONS)), lr=0.02, **muon_options)
    return {"muon": muon, "adamw": torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW_OPTIONS)}


@contextlib.contextmanager
def ns_batch(value: str) -> Iterator[None]:
    """``MUON_DTENSOR_NS_BATCH=value`` for the block (read at each call), then as it was."""
    old = os.environ.get(BATCH_ENV)
    os.environ[BATCH_ENV] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[BATCH_ENV]
        else:
            os.environ[BATCH_ENV] = old


def count_step(opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    """Inside a rank: one ``opt.step()`` under the profiler, with ``MUON_DTENSOR_NS_BATCH=path``:
    top-level ``aten::`` ops, collectives (top-level ``c10d::`` ops), and how many of each name."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with ns_batch(path):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
    top = top_level_ops(prof)
    collectives = sorted(n for n in top if n.startswith("c10d::"))
    ops = sorted(n for n in top if n.startswith("aten::"))
    return {
        "ops": len(ops),
        "op_names": {n: ops.count(n) for n in dict.fromkeys(ops)},
        "collectives": len(collectives),
        "collective_names": {n: collectives.count(n) for n in dict.fromkeys(collectives)},
    }


def warm_up(opts: dict[str, torch.optim.Optimizer], warmup: int) -> dict[str, float]:
    """``warmup`` untimed steps per contender; the seconds of each one's first step (its state and
    plan are built then, and DTensor's sharding propagation fills its caches)."""
    first = {}
    for label, (kind, path) in CONTENDERS.items():
        with ns_batch(path):
            for i in range(warmup):
                start = time.perf_counter()
                opts[kind].step()
                if i == 0:
                    first[label] = time.perf_counter() - start
    return first


def timed_steps(opts: dict[str, torch.optim.Optimizer], steps: int) -> dict[str, dict[str, list[float]]]:
    """Rounds of one barrier-started step per contender, the order rotated each round
    (``host_stats.rotated``), so load changes touch them alike: per contender, each step's wall
    seconds and its main thread's CPU seconds (``time.thread_time``)."""
    import torch.distributed as dist

    times: dict[str, dict[str, list[float]]] = {label: {"wall": [], "cpu": []} for label in CONTENDERS}
    for r in range(steps):
        for label in rotated(list(CONTENDERS), r):
            kind, path = CONTENDERS[label]
            with ns_batch(path):
                dist.barrier()
                cpu, start = time.thread_time(), time.perf_counter()
                opts[kind].step()
                times[label]["wall"].append(time.perf_counter() - start)
                times[label]["cpu"].append(time.thread_time() - cpu)
    return times


def rank_counts(
    layers: list[int],
    path: str,
    warmup: int = 2,
    width: int = WIDTH,
    muon_options: dict[str, Any] | None = None,
) -> dict[int, dict[str, Any]]:
    """Inside a rank: the Muon step's counts on ``path`` at each depth, Llama layers at ``width``,
    Muon with ``muon_options`` (what tests/numerics/test_host_ops.py checks)."""
    out = {}
    for n in layers:
        muon = optimizers(sharded_model(n, width=width), **(muon_options or {}))["muon"]
        with ns_batch(path):
            for _ in range(warmup):
                muon.step()
        out[n] = count_step(muon, path)
    return out


def rank_measure(
    layers: list[int], kind: str, steps: int, warmup: int, count: bool = True, width: int = WIDTH
) -> dict[int, dict[str, Any]]:
    """Inside a rank: every contender's first-step seconds, counts (if ``count``) and step times
    (wall and main-thread CPU) at each depth."""
    torch.set_num_threads(1)
    out = {}
    for n in layers:
        opts = optimizers(sharded_model(n, kind, width))
        first = warm_up(opts, warmup)
        counts = {label: count_step(opts[k], p) if count else {} for label, (k, p) in CONTENDERS.items()}
        times = timed_steps(opts, steps)
        out[n] = {
            label: counts[label]
            | {"times": times[label]["wall"], "cpu_times": times[label]["cpu"]}
            | {"first_s": first[label]}
            for label in CONTENDERS
        }
    return out


def many_layers_within(probe: tuple[float, float], probe_layers: int, seconds: float, most: int) -> int:
    """Layers of the many-matrices case that fit ``seconds``, from a probe at ``probe_layers``:
    (AdamW's first step, everything else). torch's sharding propagation of a DTensor foreach op
    walks the whole list once per element, so AdamW's first step grows with the square of the
    matrices; the rest grows linearly."""
    square, linear = max(probe[0], 1e-6), probe[1]
    x = (-linear + math.sqrt(linear**2 + 4 * square * max(seconds, 0.0))) / (2 * square)
    return max(probe_layers, min(most, int(probe_layers * x)))


def rank_many(most: int, seconds: float, steps: int, warmup: int, count: bool = True) -> dict[str, Any]:
    """Inside a rank: the many-matrices case at the most layers (up to ``most``) that fit ``seconds``
    after a probe at PROBE_LAYERS; every rank takes the same pick (the slowest rank's probe)."""
    import torch.distributed as dist

    start = time.perf_counter()
    probe = rank_measure([PROBE_LAYERS], "square", steps, warmup, count=False)[PROBE_LAYERS][ADAMW]["first_s"]
    times = torch.tensor([probe, time.perf_counter() - start - probe], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    left = USABLE * (seconds - (time.perf_counter() - start))
    layers = many_layers_within((times[0].item(), times[1].item()), PROBE_LAYERS, left, most)
    return {
        "layers": layers,
        "probe_s": times.tolist(),
        "rows": rank_measure([layers], "square", steps, warmup, count=count),
    }


def avx512_bf16() -> bool:
    return "avx512_bf16" in host_cpu()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="L: models of L and 2L layers (8)")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated gloo ranks (2,4)")
    p.add_argument("--steps", type=int, default=15, help="timed rounds, depth case (15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (2)")
    p.add_argument(
        "--many-layers", type=int, default=250, help="most layers of 4 matrices, second case (250)"
    )
    p.add_argument(
        "--budget", type=float, default=270.0, help="s the whole run should take; sizes case 2 (270)"
    )
    p.add_argument("--many-steps", type=int, default=30, help="timed rounds, many matrices (30)")
    p.add_argument("--no-count-many", dest="count_many", action="store_false", help="skip the profiler there")
    p.add_argument("--wide-layers", type=int, default=8, help="layers of bench_step.py's set (8)")
    p.add_argument("--wide-width", type=int, default=512, help="their width (512)")
    p.add_argument("--wide-steps", type=int, default=7, help="timed rounds of that set (7)")
    p.add_argument("--cases", default="depth,wide,many", help="which cases to run (depth,wide,many)")
    p.add_argument("--timeout", type=float, default=600.0, help="rank timeout, s (600)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def run_depth(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    """The L and 2L rows at every world size, with ops added per layer."""
    from benchmarks import bench_host
    from muon_dtensor.testing import run_ranks

    depth: list[dict[str, Any]] = []
    for n in sizes:
        layers = [args.layers, 2 * args.layers]
        per_rank = run_ranks(
            bench_host.rank_measure, n, layers, "llama", args.steps, args.warmup, timeout=args.timeout
        )
        depth += summarize(per_rank, n, list(CONTENDERS), ADAMW)
    per_layer(depth, args.layers, ADAMW)
    return depth


def run_many(args: argparse.Namespace, left: float) -> dict[str, Any]:
    """The many-matrices case in ``left`` seconds: matrices picked, probe seconds, rows."""
    from benchmarks import bench_host
    from muon_dtensor.testing import run_ranks

    ranks = run_ranks(bench_host.rank_many, 2, args.many_layers, left, args.many_steps, args.warmup,
                      args.count_many, timeout=args.timeout)  # fmt: skip
    rows = summarize([r["rows"] for r in ranks], 2, list(CONTENDERS), ADAMW)
    print(f"picked: {4 * ranks[0]['layers']:,} matrices at 2 ranks (at most {4 * args.many_layers:,}; "
          f"{left:.0f} s left of --budget, AdamW's first step {ranks[0]['probe_s'][0]:.1f} s at "
          f"{4 * PROBE_LAYERS} matrices), {args.many_steps} timed rounds")  # fmt: skip
    return {"many_matrices": 4 * ranks[0]["layers"], "many_probe_s": ranks[0]["probe_s"], "many_rows": rows}


def run_wide(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``bench_step.py``'s default set (8 layers at width 512) on 2 ranks, counted and timed."""
    from benchmarks import bench_host
    from muon_dtensor.testing import run_ranks

    per_rank = run_ranks(bench_host.rank_measure, 2, [args.wide_layers], "default", args.wide_steps,
                         args.warmup, True, args.wide_width, timeout=args.timeout)  # fmt: skip
    return summarize(per_rank, 2, list(CONTENDERS), ADAMW)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    load = wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    cases = set(args.cases.split(","))
    sizes = [int(n) for n in args.world_sizes.split(",")]
    payload: dict[str, Any] = {}
    if "depth" in cases:
        print(
            f"picked: L = {args.layers} and {2 * args.layers} layers at {sizes} ranks, {args.steps} timed rounds"
        )
        payload["depth_rows"] = run_depth(args, sizes)
        print(format_depth(payload["depth_rows"]) + "\n")
    if "wide" in cases:
        payload["wide_rows"] = run_wide(args)
        title = f"{args.wide_layers} layers of width {args.wide_width} (bench_step.py's set), 2 ranks:"
        print(format_timed(payload["wide_rows"], title) + "\n")
    if "many" in cases:
        payload |= run_many(args, args.budget - (time.perf_counter() - started) - START_UP_S)
        title = f"{payload['many_matrices']:,} matrices of {WIDTH} x {WIDTH}, 2 ranks:"
        print(format_timed(payload["many_rows"], title))
    if "depth" in cases and max(sizes) > (os.cpu_count() or 1):
        print(f"NOTE: {max(sizes)} ranks on {os.cpu_count()} cores are oversubscribed (time-shared).")
    elapsed = time.perf_counter() - started
    print(f"load average at start (1, 5, 15 min): {load['loadavg_1_5_15_min']}, at the end "
          f"{os.getloadavg()}; run took {elapsed:.0f} s")  # fmt: skip
    payload = {**system_info(), "avx512_bf16": avx512_bf16(), "config": results_config(args)} | {
        "load_at_start": load, "elapsed_s": round(elapsed, 1), **payload
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
