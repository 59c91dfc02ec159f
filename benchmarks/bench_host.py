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
Second case: 1,000 matrices of 16 x 16 (250 layers of 4), 2 ranks: host time against AdamW, and
each contender's first step (state, plan and DTensor's sharding-propagation caches are built then);
not counted, since the profiler takes tens of seconds to list that many events.

Run from the repository root (about 2 minutes on a 2-core machine)::

    python benchmarks/bench_host.py
    python benchmarks/bench_host.py --layers 4 --steps 5 --many-layers 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
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
from muon_dtensor.newton_schulz import BATCH_ENV  # noqa: E402

WIDTH, KV, FFN, VOCAB = 16, 8, 48, 64
ADAMW_OPTIONS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
# label -> (optimizer, MUON_DTENSOR_NS_BATCH while it steps)
CONTENDERS = {
    "muon_dtensor, CPU path (never)": ("muon", "never"),
    "muon_dtensor, CUDA batching (always)": ("muon", "always"),
    "torch AdamW foreach": ("adamw", "never"),
}
ADAMW = "torch AdamW foreach"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_host.json"


class LlamaLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.q, self.o = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.k, self.v = nn.Linear(WIDTH, KV, bias=False), nn.Linear(WIDTH, KV, bias=False)
        self.gate, self.up = nn.Linear(WIDTH, FFN, bias=False), nn.Linear(WIDTH, FFN, bias=False)
        self.down = nn.Linear(FFN, WIDTH, bias=False)


class SquareLayer(nn.Module):
    """Four 16 x 16 matrices, for the many-matrices case."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))


class Model(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.RMSNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)


def sharded_model(layers: int, kind: str = "llama") -> nn.Module:
    """Inside a rank: a seeded model, ``fully_shard`` per layer and on the root, seeded gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    make = LlamaLayer if kind == "llama" else SquareLayer
    model = Model([make() for _ in range(layers)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def optimizers(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    from muon_dtensor import Muon, split_params

    muon = Muon(split_params(model, adamw_options=dict(ADAMW_OPTIONS)), lr=0.02)
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


def _is_op(name: str) -> bool:
    return name.startswith(("aten::", "c10d::"))


def _top_level(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def count_step(opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    """Inside a rank: one ``opt.step()`` under the profiler, with ``MUON_DTENSOR_NS_BATCH=path``:
    top-level ``aten::`` ops, collectives (top-level ``c10d::`` ops) and the collectives' names."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    with ns_batch(path):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
    top = [e.name for e in prof.profiler.function_events if _is_op(e.name) and _top_level(e)]
    collectives = sorted(n for n in top if n.startswith("c10d::"))
    return {
        "ops": sum(n.startswith("aten::") for n in top),
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


def timed_steps(opts: dict[str, torch.optim.Optimizer], steps: int) -> dict[str, list[float]]:
    """Rounds of one barrier-started step per contender, so load changes touch them alike."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {label: [] for label in CONTENDERS}
    for _ in range(steps):
        for label, (kind, path) in CONTENDERS.items():
            with ns_batch(path):
                dist.barrier()
                start = time.perf_counter()
                opts[kind].step()
                times[label].append(time.perf_counter() - start)
    return times


def rank_counts(layers: list[int], path: str, warmup: int = 2) -> dict[int, dict[str, Any]]:
    """Inside a rank: the Muon step's counts on ``path`` at each depth (what tests/test_host_ops.py
    checks)."""
    out = {}
    for n in layers:
        muon = optimizers(sharded_model(n))["muon"]
        with ns_batch(path):
            for _ in range(warmup):
                muon.step()
        out[n] = count_step(muon, path)
    return out


def rank_measure(
    layers: list[int], kind: str, steps: int, warmup: int, count: bool = True
) -> dict[int, dict[str, Any]]:
    """Inside a rank: every contender's first-step seconds, counts (if ``count``) and step times at
    each depth."""
    torch.set_num_threads(1)
    out = {}
    for n in layers:
        opts = optimizers(sharded_model(n, kind))
        first = warm_up(opts, warmup)
        nothing = {"ops": 0, "collectives": 0, "collective_names": {}}
        counts = {
            label: count_step(opts[k], path) if count else nothing for label, (k, path) in CONTENDERS.items()
        }
        times = timed_steps(opts, steps)
        out[n] = {
            label: counts[label] | {"times": times[label], "first_s": first[label]} for label in CONTENDERS
        }
    return out


def summarize(per_rank: list[dict[int, dict[str, Any]]], ranks: int) -> list[dict[str, Any]]:
    """Rows (contender, ranks, layers): counts of the rank with most ops, median slowest-rank ms."""
    rows = []
    for layers in per_rank[0]:
        for label in CONTENDERS:
            at = [r[layers][label] for r in per_rank]
            busiest = max(at, key=lambda c: c["ops"])
            slowest = [max(t) for t in zip(*(c["times"] for c in at), strict=True)]
            rows.append(
                {"contender": label, "ranks": ranks, "layers": layers, "ops": busiest["ops"]}
                | {"ops_each_rank": [c["ops"] for c in at], "collectives": busiest["collectives"]}
                | {"collective_names": busiest["collective_names"]}
                | {"median_ms": statistics.median(slowest) * 1e3, "step_ms": [t * 1e3 for t in slowest]}
                | {"first_step_s": max(c["first_s"] for c in at)}
            )
    return rows


def per_layer(rows: list[dict[str, Any]], layers: int) -> None:
    """Add ops added per layer, and its ratio to AdamW's at the same ranks, to every depth row."""
    ops = {(r["contender"], r["ranks"], r["layers"]): r["ops"] for r in rows}
    for r in rows:
        deep, shallow = ((r["contender"], r["ranks"], n) for n in (2 * layers, layers))
        r["ops_per_layer"] = (ops[deep] - ops[shallow]) / layers
    for r in rows:
        adamw = next(a for a in rows if a["contender"] == ADAMW and a["ranks"] == r["ranks"])
        r["ratio_per_layer_to_adamw"] = r["ops_per_layer"] / adamw["ops_per_layer"]


def format_depth(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer / path | ranks | layers | top-level ops/step | ops added per layer "
        "| ratio to AdamW's | collectives/step | host ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['ranks']} | {r['layers']} | {r['ops']:,} | {r['ops_per_layer']:.1f} "
            f"| {r['ratio_per_layer_to_adamw']:.1f} | {r['collectives']} | {r['median_ms']:.1f} |"
        )
    return "\n".join(lines)


def format_many(rows: list[dict[str, Any]], matrices: int) -> str:
    adamw = next(r for r in rows if r["contender"] == ADAMW)
    lines = [
        f"{matrices:,} matrices of {WIDTH} x {WIDTH}, 2 ranks:",
        "| optimizer / path | host ms/step | ratio to AdamW | first step s |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        r["ratio_ms_to_adamw"] = r["median_ms"] / adamw["median_ms"]
        lines.append(
            f"| {r['contender']} | {r['median_ms']:.1f} | {r['ratio_ms_to_adamw']:.2f} "
            f"| {r['first_step_s']:.1f} |"
        )
    return "\n".join(lines)


def avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="L: models of L and 2L layers (8)")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated gloo ranks (2,4)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per contender (15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (2)")
    p.add_argument("--many-layers", type=int, default=250, help="layers of 4 matrices, second case (250)")
    p.add_argument("--many-steps", type=int, default=5, help="timed steps, second case (5)")
    p.add_argument("--timeout", type=float, default=600.0, help="rank timeout, s (600)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    from benchmarks import bench_host
    from muon_dtensor.demo.launch import run_ranks

    load = wait_for_quiet(args.wait_quiet)
    started = time.perf_counter()
    sizes = [int(n) for n in args.world_sizes.split(",")]
    print(f"picked: L = {args.layers} and {2 * args.layers} layers at {sizes} ranks, {args.steps} timed "
          f"steps; {args.many_layers * 4:,} matrices at 2 ranks, {args.many_steps} timed steps")  # fmt: skip
    depth: list[dict[str, Any]] = []
    for n in sizes:
        layers = [args.layers, 2 * args.layers]
        per_rank = run_ranks(
            bench_host.rank_measure, n, layers, "llama", args.steps, args.warmup, timeout=args.timeout
        )
        depth += summarize(per_rank, n)
    per_layer(depth, args.layers)
    per_rank = run_ranks(
        bench_host.rank_measure, 2, [args.many_layers], "square", args.many_steps, args.warmup, False,
        timeout=args.timeout,
    )  # fmt: skip
    many = [r | {"ops": None, "collectives": None} for r in summarize(per_rank, 2)]  # not counted
    print(format_depth(depth))
    print()
    print(format_many(many, 4 * args.many_layers))
    if max(sizes) > (os.cpu_count() or 1):
        print(f"NOTE: {max(sizes)} ranks on {os.cpu_count()} cores are oversubscribed (time-shared).")
    elapsed = time.perf_counter() - started
    print(f"load average at start (1, 5, 15 min): {load['loadavg_1_5_15_min']}; run took {elapsed:.0f} s")
    payload = {**system_info(), "avx512_bf16": avx512_bf16(), "config": results_config(args)}
    payload |= {"load_at_start": load, "elapsed_s": round(elapsed, 1), "depth_rows": depth, "many_rows": many}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
