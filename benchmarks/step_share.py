"""The optimizer's share of a training step, Muon against AdamW: predicted, and measured on 2 ranks.

    python benchmarks/step_share.py                      # Llama-3 8B / 70B on H200s -> results/step_share.json
    python benchmarks/step_share.py predict --model llama3-8b --tokens 1e6 4e6 --gpus 64
    python benchmarks/step_share.py predict --layers 24 --dim 2048 --ffn 8192 --params 1.3e9 --tokens 5e5 --gpus 8
    python benchmarks/step_share.py measure              # FSDP2, 2 gloo ranks -> results/step_share_measured.json

``predict`` (``muon_dtensor.planning.step_share``): forward and backward take ``6 N T`` FLOPs at 40%
of the H200's 989 TFLOP/s (an assumption, ``--mfu``); AdamW's step is its float32 bytes at the
memory bandwidth plus its host ops; Muon's is the cost model's prediction for the hidden matrices
(``predict(..., split=True)``) plus AdamW on the rest. The share falls as tokens per step grow.

``measure``: the demo's ``TinyLM`` at width 512 (2 layers, 8 heads, context 128) under FSDP2 on 2
gloo ranks, one thread each, the train_benefit arms (Newton-Schulz in float32). Each step: a
barrier, forward and backward timed; a barrier, the optimizer step timed; each phase's time is its
slowest rank's. Per launch 1 untimed step, then ``--steps`` timed ones at each batch size; Muon and
AdamW alternate in fresh processes (``--repeats`` of each, which goes first alternating too); the
median over every timed step. Beside it, the FLOP prediction for the same configuration
(``planning.step_share.flop_share``: on a CPU both phases run at one matmul rate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import load_snapshot, system_info  # noqa: E402
from muon_dtensor.planning.shapes import transformer_shapes  # noqa: E402
from muon_dtensor.planning.step_share import MFU, MODELS, PEAK_FLOPS, StepShare, flop_share, step_share  # noqa: E402

GPUS, TOKENS = (8, 64, 1024), (0.5e6, 1e6, 4e6)
WIDTH, LAYERS, HEADS, SEQ = 512, 2, 8, 128
LR = {"muon": 0.02, "adamw": 4e-3}  # timing only: the values do not change the work


def _row(name: str, share: StepShare) -> dict[str, Any]:
    return {
        "model": name,
        "gpus": share.gpus,
        "tokens": share.tokens,
        "train_s": share.train_s,
        "muon_ms": share.muon_s * 1e3,
        "adamw_ms": share.adamw_s * 1e3,
        "muon_share": share.muon_share,
        "adamw_share": share.adamw_share,
        "step_ratio": share.step_ratio,
    }


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | GPUs | tokens/step | fwd+bwd s | Muon step ms | AdamW step ms | Muon share | AdamW share | step ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['gpus']:,} | {r['tokens'] / 1e6:g}M | {r['train_s']:.3f} | {r['muon_ms']:.1f} "
            f"| {r['adamw_ms']:.1f} | {100 * r['muon_share']:.2f}% | {100 * r['adamw_share']:.2f}% | {r['step_ratio']:.4f} |"
        )


def table() -> None:
    """The published table: Llama-3 8B and 70B, 8 to 1,024 H200s, 0.5M to 4M tokens a step."""
    rows = [
        _row(name, step_share(shapes, total, gpus, tokens))
        for name, (shapes, total) in MODELS.items()
        for gpus in GPUS
        for tokens in TOKENS
    ]
    _print(rows)
    out = ROOT / "benchmarks" / "results" / "step_share.json"
    assumptions = {"peak_flops": PEAK_FLOPS, "mfu": MFU, "adamw_bytes_per_element": 28}
    out.write_text(json.dumps({"assumptions": assumptions, "rows": rows}, indent=1) + "\n")


def predict_cmd(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="step_share.py predict", description="Muon's share of a step, predicted")
    p.add_argument("--model", choices=sorted(MODELS), help="or give --layers, --dim, --ffn and --params")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--ffn", type=int, help="MLP width (gated, as Llama's)")
    p.add_argument("--kv-rows", type=int, help="rows of k and v (grouped-query attention); default dim")
    p.add_argument("--params", type=float, help="all parameters, embeddings and head included")
    p.add_argument("--tokens", type=float, nargs="+", required=True, help="tokens per step")
    p.add_argument("--gpus", type=int, nargs="+", required=True)
    p.add_argument("--mfu", type=float, default=MFU)
    args = p.parse_args(argv)
    if args.model:
        shapes, total, name = *MODELS[args.model], args.model
    elif None in (args.layers, args.dim, args.ffn, args.params):
        p.error("give --model, or all of --layers, --dim, --ffn and --params")
    else:
        shapes = transformer_shapes(args.layers, args.dim, kv_rows=args.kv_rows, ffn=args.ffn, gated=True)
        total, name = args.params, f"{args.layers}x{args.dim}"
    _print(
        [_row(name, step_share(shapes, total, g, t, mfu=args.mfu)) for g in args.gpus for t in args.tokens]
    )


def _time_rank(arm: str, batches: list[int], steps: int) -> list[dict[str, Any]]:
    """Rank function: per batch size, each timed step's (forward+backward, optimizer) seconds."""
    import torch
    import torch.distributed as dist

    from benchmarks.train_benefit import Setup, build_optimizer
    from muon_dtensor.demo.model import TinyLM
    from muon_dtensor.demo.parallel import build_mesh, demo_shape, shard_model

    torch.set_num_threads(1)
    setup = Setup(arm, LR[arm], dim=WIDTH, layers=LAYERS, heads=HEADS, seq=SEQ)
    torch.manual_seed(0)
    model = TinyLM(setup.model_config())
    shard_model(model, build_mesh(demo_shape("fsdp", dist.get_world_size())))
    opt, _ = build_optimizer(model, setup)
    out = []
    for batch in batches:
        times: list[tuple[float, float]] = []
        for i in range(1 + steps):
            tokens = torch.randint(0, 256, (batch // dist.get_world_size(), SEQ + 1))
            dist.barrier()
            t0 = time.perf_counter()
            model.loss(tokens).backward()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= 1:
                times.append((t1 - t0, time.perf_counter() - t2))
        out.append({"batch": batch, "times": times})
    return out


def _hidden_shapes() -> tuple[list[tuple[int, int]], int]:
    shapes = [(WIDTH, WIDTH)] * 4 + [(4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)]
    params = LAYERS * (12 * WIDTH * WIDTH + 4 * WIDTH) + 2 * 256 * WIDTH + SEQ * WIDTH + 2 * WIDTH
    return shapes * LAYERS, params


def measure(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="step_share.py measure")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="sequences of 128 per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_share_measured.json")
    args = p.parse_args(argv)
    from muon_dtensor.testing import run_ranks

    raw: dict[str, dict[int, list[tuple[float, float]]]] = {a: {b: [] for b in args.batches} for a in LR}
    loads = [load_snapshot()]
    for rep in range(args.repeats):
        for arm in ("muon", "adamw") if rep % 2 == 0 else ("adamw", "muon"):
            ranks = run_ranks(
                "benchmarks.step_share:_time_rank", 2, arm, args.batches, args.steps, timeout=1800.0
            )
            for per_batch in zip(*ranks, strict=True):
                for steps in zip(*(r["times"] for r in per_batch), strict=True):
                    raw[arm][per_batch[0]["batch"]].append(
                        (max(s[0] for s in steps), max(s[1] for s in steps))
                    )
            loads.append(load_snapshot())
    rows = [_measured_row(args.batches, b, raw) for b in args.batches]
    for r in rows:
        print(
            f"batch {r['tokens']} tokens: Muon {100 * r['muon_share']:.1f}% of its step (predicted "
            f"{100 * r['predicted_muon_share']:.1f}%), AdamW {100 * r['adamw_share']:.1f}%, step ratio {r['step_ratio']:.3f}"
        )
    config = {"width": WIDTH, "layers": LAYERS, "heads": HEADS, "seq": SEQ, "ranks": 2, **vars(args)}
    config["out"] = (
        str(args.out.resolve().relative_to(ROOT)) if args.out.resolve().is_relative_to(ROOT) else "elsewhere"
    )
    shapes, total = MODELS["llama3-8b"]
    h200 = [_row("llama3-8b", step_share(shapes, total, 64, t)) for t in (1e6, 4e6)]
    doc = {
        "config": config,
        "rows": rows,
        "h200_predicted": h200,
        "loads": loads,
        "raw": raw,
        "system": system_info(),
    }
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def _measured_row(
    batches: list[int], batch: int, raw: dict[str, dict[int, list[tuple[float, float]]]]
) -> dict[str, Any]:
    med = {a: [statistics.median(t[i] for t in raw[a][batch]) for i in (0, 1)] for a in raw}
    shapes, params = _hidden_shapes()
    tokens = batch * SEQ
    return {
        "tokens": tokens,
        "muon_fwd_bwd_s": med["muon"][0],
        "muon_opt_s": med["muon"][1],
        "adamw_fwd_bwd_s": med["adamw"][0],
        "adamw_opt_s": med["adamw"][1],
        "muon_share": med["muon"][1] / sum(med["muon"]),
        "adamw_share": med["adamw"][1] / sum(med["adamw"]),
        "step_ratio": sum(med["muon"]) / sum(med["adamw"]),
        "predicted_muon_share": flop_share(shapes, params, 2, tokens),
        "timed_steps": len(raw["muon"][batch]),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"predict": predict_cmd, "measure": measure}
    if argv and argv[0] in commands:
        commands[argv[0]](argv[1:])
    else:
        table()


if __name__ == "__main__":
    main()
