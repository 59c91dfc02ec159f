"""Muon's share of a one-GPU training step, side by side with torch.optim.Muon and fused AdamW.

The demo's ``TinyLM`` (pre-norm attention and a GELU MLP, fp32 weights, forward and backward under
bf16 autocast) at two sizes, each at two batch sizes, four optimizer arms in one run, each on a
fresh copy of the model (seed 0) and the same random tokens:

  - ``muon_dtensor.Muon``: ``split_params`` (hidden matrices to Muon, embeddings, positions, head
    and norms to its AdamW group), defaults otherwise;
  - the same with ``max_round_bytes=64 MiB`` (the round bound that limits Newton-Schulz's batches);
  - ``torch.optim.Muon`` on the same hidden matrices and fused ``torch.optim.AdamW`` on the rest;
  - fused ``torch.optim.AdamW`` on every parameter.

Each step: CUDA events around forward+backward and around ``opt.step(); opt.zero_grad()`` (the
optimizer's time on the stream, idle gaps included, so a host slower than the device counts), 3
untimed steps then 10 timed, the median; the peak memory allocated over the arm's steps. Muon's
share is optimizer / (forward+backward + optimizer); the FLOP prediction is
``planning.step_share.flop_share`` on one GPU (Newton-Schulz FLOPs against 6 N T).

Protocol, fixed before the first run: the verdict per row is muon_dtensor.Muon's optimizer time
over torch.optim.Muon + fused AdamW's (the drop-in's price on one GPU, goal at most 1.10) and its
whole step over fused AdamW's; both are printed whatever they are. ``--budget-s`` is a deadline:
an arm not started before it is skipped and recorded as such. ``--dry-run`` (or no CUDA) runs tiny
shapes on CPU with perf_counter times, to check the script, not to measure.

    PYTHONPATH=$PWD python3 benchmarks/gpu_step_share.py --budget-s 300   # $OUT/gpu_step_share.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.getcwd())
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.demo.model import ModelConfig, TinyLM  # noqa: E402
from muon_dtensor.planning.step_share import flop_share  # noqa: E402

# name: (model config, sequences per step)
FULL = {
    "width 1024 x 8 layers": (ModelConfig(vocab=32768, dim=1024, layers=8, heads=16, seq=1024), [8, 32]),
    "width 2048 x 16 layers": (ModelConfig(vocab=32768, dim=2048, layers=16, heads=16, seq=2048), [4, 16]),
}
DRY = {"dry: width 64 x 2 layers": (ModelConfig(vocab=256, dim=64, layers=2, heads=4, seq=32), [2, 4])}
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.0}  # every arm's AdamW, ours and torch's
WARMUP, REPS = 3, 10


class Pair:
    """Two optimizers stepped as one (torch.optim.Muon takes 2-D matrices only)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def build(arm: str, model: TinyLM, fused: bool) -> Muon | Pair | torch.optim.Optimizer:
    """The arm's optimizer over ``model``: Muon groups as ``split_params`` makes them."""
    groups = split_params(model, adamw=("pos",), adamw_options=dict(ADAMW))
    if arm == "muon_dtensor.Muon 64 MiB rounds":
        return Muon(groups, lr=0.02, max_round_bytes=64 << 20)
    if arm == "muon_dtensor.Muon":
        return Muon(groups, lr=0.02)
    hidden, rest = groups[0]["params"], groups[1]["params"]
    adamw = partial(torch.optim.AdamW, fused=fused, **ADAMW)
    if arm == "torch.optim.Muon + fused AdamW":
        return Pair(torch.optim.Muon(hidden, lr=0.02), adamw(rest))
    return adamw(model.parameters())


ARMS = [
    "muon_dtensor.Muon",
    "muon_dtensor.Muon 64 MiB rounds",
    "torch.optim.Muon + fused AdamW",
    "fused AdamW",
]


def _timer(device: torch.device) -> Callable[[], Callable[[], float]]:
    """A mark: call it to start, call what it returns to get ms since (CUDA events, else perf_counter)."""

    def mark() -> Callable[[], float]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()

            def stop() -> float:
                end.record()
                torch.cuda.synchronize()
                return start.elapsed_time(end)

            return stop
        t0 = time.perf_counter()
        return lambda: 1e3 * (time.perf_counter() - t0)

    return mark


def run_arm(
    arm: str, cfg: ModelConfig, batch: int, device: torch.device, reps: int, warmup: int = WARMUP
) -> dict[str, Any]:
    """One arm on a fresh model: the median forward+backward and optimizer ms of ``reps`` steps after
    ``warmup``, the peak memory over them (CUDA), the last loss."""
    torch.manual_seed(0)
    with device:
        model = TinyLM(cfg)
    opt = build(arm, model, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    mark, fb, op = _timer(device), [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + reps):
        t = mark()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model.loss(tokens)
        loss.backward()
        fb_ms = t()
        t = mark()
        opt.step()
        opt.zero_grad(set_to_none=True)
        op_ms = t()
        if i >= warmup:
            fb.append(fb_ms)
            op.append(op_ms)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {
        "fwd_bwd_ms": statistics.median(fb),
        "opt_ms": statistics.median(op),
        "peak_gib": peak,
        "loss_last": float(loss.detach()),
        "fwd_bwd_all": fb,
        "opt_all": op,
    }


def predicted(model_cfg: ModelConfig, tokens: int) -> float:
    d, h = model_cfg.dim, model_cfg.mlp_ratio * model_cfg.dim
    shapes = [(d, d)] * 4 + [(h, d), (d, h)]
    # 6 N T with N the matmul weights forward and backward touch per token: hidden and the head
    n = model_cfg.layers * (4 * d * d + 2 * d * h) + model_cfg.vocab * d
    return flop_share(shapes * model_cfg.layers, n, 1, tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    out = args.out or Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_step_share.json"
    doc: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if not dry else "cpu",
        "dry_run": dry,
        "budget_s": args.budget_s,
        "warmup": WARMUP,
        "reps": 1 if dry else REPS,
        "rows": [],
    }
    t0 = time.monotonic()
    for name, (cfg, batches) in (DRY if dry else FULL).items():
        for batch in batches:
            for arm in ARMS:
                row: dict[str, Any] = {"model": name, "tokens": batch * cfg.seq, "arm": arm}
                if time.monotonic() - t0 > args.budget_s:
                    row["skipped"] = "past the budget"
                else:
                    try:
                        row.update(run_arm(arm, cfg, batch, device, doc["reps"]))
                    except Exception as e:  # noqa: BLE001 - recorded, the other arms still run
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                row["predicted_share"] = predicted(cfg, batch * cfg.seq)
                doc["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(doc, indent=1) + "\n")
    doc["elapsed_s"] = time.monotonic() - t0
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc["rows"])
    return 0 if all("error" not in r for r in doc["rows"]) else 1


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | tokens | arm | fwd+bwd ms | optimizer ms | share | predicted | opt / torch pair | step / AdamW | peak GiB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["model"], r["tokens"], r["arm"]): r for r in rows if "opt_ms" in r}
    for r in rows:
        if "opt_ms" not in r:
            print(f"| {r['model']} | {r['tokens']} | {r['arm']} | {r.get('error') or r.get('skipped')} |")
            continue
        pair = by.get((r["model"], r["tokens"], "torch.optim.Muon + fused AdamW"))
        adamw = by.get((r["model"], r["tokens"], "fused AdamW"))
        step = r["fwd_bwd_ms"] + r["opt_ms"]
        ratio = f"{r['opt_ms'] / pair['opt_ms']:.2f}" if pair else "-"
        vs_adamw = f"{step / (adamw['fwd_bwd_ms'] + adamw['opt_ms']):.3f}" if adamw else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        pred = "-" if r["arm"] == "fused AdamW" else f"{100 * r['predicted_share']:.1f}%"
        print(
            f"| {r['model']} | {r['tokens']} | {r['arm']} | {r['fwd_bwd_ms']:.1f} | {r['opt_ms']:.1f} | "
            f"{100 * r['opt_ms'] / step:.1f}% | {pred} | {ratio} | {vs_adamw} | {peak} |"
        )


if __name__ == "__main__":
    sys.exit(main())
