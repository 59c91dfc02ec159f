"""Calibrate the cost model (muon_dtensor/planning/costmodel.py) here; check it against measured steps.

Measures, each with one torch thread as the optimizer runs here:

1. the bf16 Newton-Schulz flop rate: ``newton_schulz`` on one matrix of each shape of the sets
   (the CPU path runs one matrix at a time), flops from ``ns_flops``;
2. the elementwise memory rate: ``elementwise.muon_momentum`` + ``apply_muon_update`` on large fp32
   tensors, counting the bytes the model counts for them (``Implementation``: 88 per element);
3. the host overhead of one eager op: a ``muon_dtensor.Muon`` step over many tiny matrices, divided
   by the ops the model counts for it (so it includes Python per matrix, not only dispatch);
4. gloo all-to-all between 2 local ranks (``muon_dtensor.testing.run_ranks``): latency and bandwidth fitted over
   three message sizes.

Then it times ``muon_dtensor.Muon(mode="owner")`` on ``Shard(0)`` DTensors at 1 and 2 ranks for the
GPT-2-like and Llama-like sets (benchmarks/common.py) the way bench_step.py does (fresh processes,
barrier, slowest rank per step, median), predicts the same steps from the fitted ``Hardware``, and
prints measured against predicted. Target: within 25%.

Example, from the repository root (about a minute and a half)::

    python benchmarks/calibrate.py
    python benchmarks/calibrate.py --sets llama --steps 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import set_shapes, system_info, wait_for_quiet  # noqa: E402
from muon_dtensor import newton_schulz, resolve_ns_config  # noqa: E402
from muon_dtensor.numerics.newton_schulz import ns_flops  # noqa: E402
from muon_dtensor.planning.costmodel import CURRENT_CPU, Hardware, predict  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "calibrate.json"
SETS = ["gpt2", "llama"]
TOLERANCE = 0.25  # goal: predicted within 25% of measured
NS_STEPS = 5
A2A_BYTES = [2**19, 2**22, 2**24]  # sent to the other rank: 0.5, 4 and 16 MiB
TINY = (4, 4)  # op-overhead probe: matrices this small cost only host time
TINY_COUNT = 256
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sets", default=",".join(SETS), help="comma-separated matrix sets (gpt2,llama)")
    p.add_argument("--steps", type=int, default=7, help="timed optimizer steps (7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--wait-quiet", type=float, default=0.0, help="wait up to this many s for a quiet machine")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- microbenchmarks
def measure_ns(shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Seconds of 5 Newton-Schulz iterations on one matrix of each distinct shape."""
    config = resolve_ns_config((3.4445, -4.7750, 2.0315), NS_STEPS, 1e-7)
    gen = torch.Generator().manual_seed(SEED)
    out = []
    for shape in sorted(set(shapes)):
        x = torch.randn(1, *shape, generator=gen).bfloat16()
        seconds = median_seconds(lambda x=x: newton_schulz(x, config), reps=5)
        out.append({"shape": shape, "flops": ns_flops(shape, NS_STEPS), "seconds": seconds})
    return out


def measure_memory(numel: int = 2**22) -> dict[str, float]:
    """The momentum and update passes on ``numel`` fp32 elements, in the pieces the step uses
    (``elementwise.buckets``); bytes as the model counts them."""
    from muon_dtensor.numerics.elementwise import apply_muon_update, buckets, muon_momentum, scale_updates

    gen = torch.Generator().manual_seed(SEED)
    param, grad, buf = (torch.randn(numel, generator=gen) for _ in range(3))

    def passes() -> None:
        ns_in, scaled = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel)
        for _, (b, g, out) in buckets([[buf], [grad], [ns_in]]):
            muon_momentum(b, g, out, 0.95, True)
        for _, (p, u, s) in buckets([[param], [ns_in], [scaled]]):
            scale_updates(u, s, [0.02])
            apply_muon_update(p, s, lr=0.02, weight_decay=0.1)

    seconds = median_seconds(passes, reps=7)
    return {"bytes": numel * (CURRENT_CPU.pre_bytes + CURRENT_CPU.post_bytes), "seconds": seconds}


def measure_op_overhead() -> dict[str, float]:
    """Host seconds per eager op: a Muon step over TINY_COUNT tiny matrices over the model's op count."""
    from torch import nn

    from muon_dtensor import Muon

    gen = torch.Generator().manual_seed(SEED)
    params = [nn.Parameter(torch.randn(TINY, generator=gen)) for _ in range(TINY_COUNT)]
    for p in params:
        p.grad = torch.randn(TINY, generator=gen)
    opt = Muon(params, lr=0.02)
    seconds = median_seconds(opt.step, reps=7, warmup=2)
    unit = Hardware(
        float("inf"), float("inf"), float("inf"), float("inf"), 1, 0.0, op_overhead=1.0, async_host=False
    )
    ops = predict([TINY] * TINY_COUNT, 1, unit, impl=CURRENT_CPU).host
    return {"seconds": seconds, "ops": ops, "op_overhead": seconds / ops}


def a2a_rank(sizes: list[int], reps: int) -> list[float]:
    """Inside a rank: median seconds of an all_to_all_single sending ``size`` bytes to each peer."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out = []
    for size in sizes:
        numel = size // 2  # bf16
        send = torch.randn(world * numel).bfloat16()
        recv = torch.empty_like(send)

        def once(recv: torch.Tensor = recv, send: torch.Tensor = send) -> None:
            dist.barrier()
            dist.all_to_all_single(recv, send)

        barrier_only = median_seconds(dist.barrier, reps=reps)
        out.append(max(median_seconds(once, reps=reps, warmup=2) - barrier_only, 1e-9))
    return out


def step_rank(set_name: str, warmup: int, steps: int) -> list[float]:
    """Inside a rank: owner-mode step times on Shard(0) DTensors, as bench_step.py times them."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks.bench_step import build_optimizer, make_tensors, time_steps

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    fulls, grads = make_tensors(set_shapes(set_name))
    params = [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
    for p, g in zip(params, grads, strict=True):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    return time_steps(build_optimizer("owner", params), warmup, steps, barrier=True)


# --------------------------------------------------------------------------- calibrate and compare
def calibrate(sets: list[str]) -> tuple[Hardware, dict[str, Any]]:
    """Run the microbenchmarks and fit ``Hardware``; the raw measurements too."""
    from benchmarks import calibrate as me  # run_ranks imports rank functions by module name
    from muon_dtensor.testing import run_ranks

    torch.set_num_threads(1)
    shapes = [s for name in sets for s in set_shapes(name)]
    ns = measure_ns(shapes)
    memory = measure_memory()
    ops = measure_op_overhead()
    per_rank = run_ranks(me.a2a_rank, 2, A2A_BYTES, 7, timeout=300)
    link = [(size, max(r[i] for r in per_rank)) for i, size in enumerate(A2A_BYTES)]
    hw = Hardware.from_measurements(
        matmul=[(m["flops"], m["seconds"]) for m in ns],
        memory=[(memory["bytes"], memory["seconds"])],
        link=link,
        gpus_per_node=2,  # both local ranks talk through the same memory: one "node"
        op_overhead=ops["op_overhead"],
        async_host=False,
    )
    raw = {"newton_schulz": ns, "memory": memory, "op_overhead": ops, "a2a_bytes_seconds": link}
    return hw, raw


def compare(hw: Hardware, sets: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measured and predicted owner steps at 1 and 2 ranks for each set."""
    from benchmarks import calibrate as me
    from muon_dtensor.testing import run_ranks

    rows = []
    for name in sets:
        shapes = set_shapes(name)
        for n in (1, 2):
            per_rank = run_ranks(me.step_rank, n, name, args.warmup, args.steps, timeout=900)
            slowest = [max(step) for step in zip(*per_rank, strict=True)]
            measured = statistics.median(slowest)
            p = predict(shapes, n, hw, impl=CURRENT_CPU)
            rows.append(
                {"set": name, "ranks": n, "measured_ms": measured * 1e3, "predicted_ms": p.total * 1e3}
                | {"ratio": p.total / measured, "steps_ms": [t * 1e3 for t in slowest]}
                | {"prediction": asdict(p)}
            )
    return rows


def format_hardware(hw: Hardware) -> str:
    return (
        f"calibrated: Newton-Schulz {hw.matmul_flops / 1e9:.1f} GFLOP/s, elementwise "
        f"{hw.memory_bandwidth / 1e9:.2f} GB/s (read + write), gloo all-to-all "
        f"{hw.intra_node_bandwidth / 1e9:.2f} GB/s each way + {hw.collective_latency * 1e6:.0f} us, "
        f"host {hw.op_overhead * 1e6:.1f} us per op"
    )


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| set | ranks | measured ms | predicted ms | predicted / measured | NS ms | memory ms | comm ms "
        f"| host ms | within {TOLERANCE:.0%} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p = r["prediction"]
        ok = abs(r["ratio"] - 1) <= TOLERANCE
        lines.append(
            f"| {r['set']} | {r['ranks']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['ratio']:.2f} "
            f"| {p['newton_schulz'] * 1e3:.1f} | {p['memory'] * 1e3:.1f} | {p['comm'] * 1e3:.1f} "
            f"| {p['host'] * 1e3:.1f} | {'yes' if ok else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sets = args.sets.split(",")
    load_start = wait_for_quiet(args.wait_quiet)
    hw, raw = calibrate(sets)
    rows = compare(hw, sets, args)
    print(format_hardware(hw))
    print()
    print(format_table(rows))
    ok = all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows)
    print(f"\n{'PASS' if ok else 'FAIL'}: every prediction within {TOLERANCE:.0%} of the measured step")
    payload = {**system_info(), "load_at_start": load_start, "hardware": asdict(hw), "raw": raw}
    payload |= {"rows": rows, "verdict": "PASS" if ok else "FAIL"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(
        f"load average at start (1, 5, 15 min): {load_start['loadavg_1_5_15_min']}, "
        f"other Python processes: {load_start['other_python_processes']}"
    )
    print(f"load average at end (1, 5, 15 min): {payload['loadavg_1_5_15_min_at_end']}")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
