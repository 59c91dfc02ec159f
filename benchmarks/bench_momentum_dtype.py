"""bf16 and 8-bit momentum against fp32 momentum on the demo's training run, one process.

The demo's model (``muon_dtensor.demo.model.TinyLM``, ``ModelConfig`` sizes unless ``--dim`` /
``--layers`` say otherwise), data (the generated corpus, the demo's batches: 16 sequences per step as
2 micro-batches of 8) and optimizer (``split_params`` with the demo's AdamW names and options, Muon
lr 0.02, weight decay 0.1, the demo's Newton-Schulz dtype for this CPU) trained for ``--steps``
steps five times from the same seed: fp32 momentum twice (the second run checks that the run is
deterministic, so every difference below is the momentum dtype's), ``momentum_dtype=torch.bfloat16``
once, ``momentum_dtype=torch.int8`` (8-bit blocks, arXiv 2509.23106's linear scheme) once, and, for scale, fp32 momentum with the other Newton-Schulz dtype (bf16 <-> fp32: a precision
choice the library already makes, bf16 by default). Printed: momentum state bytes and their ratio, the final step's loss, the loss on a held-out
batch after training, the largest |loss difference| over the run, the relative difference of the final
parameters ``||p_bf16 - p_fp32|| / ||p_fp32||`` (all parameters, and the Muon matrices alone) and the
median optimizer step time. One torch thread.

Examples, from the repository root::

    python benchmarks/bench_momentum_dtype.py
    python benchmarks/bench_momentum_dtype.py --dim 256 --layers 4 --steps 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import results_config, system_info  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.demo.cpu import probe  # noqa: E402
from muon_dtensor.demo.data import batch, corpus, micro_batches, tokens  # noqa: E402
from muon_dtensor.demo.model import ModelConfig, TinyLM  # noqa: E402
from muon_dtensor.demo.run import precision  # noqa: E402
from muon_dtensor.demo.train import ADAMW, ADAMW_NAMES, LR, WEIGHT_DECAY  # noqa: E402

MICRO, MICRO_SIZE = 2, 8  # the demo's global batch of 16 (2 ranks resumed on 1: 2 micro-batches)
HELD_OUT_STEP = 1_000_000  # a batch no training step draws
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "bench_momentum_dtype.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cfg = ModelConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=cfg.dim, help=f"model width (the demo's {cfg.dim})")
    p.add_argument("--layers", type=int, default=cfg.layers, help=f"blocks (the demo's {cfg.layers})")
    p.add_argument("--steps", type=int, default=40, help="training steps (the demo's 40)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def train(cfg: ModelConfig, steps: int, ns_dtype: str, momentum_dtype: torch.dtype | None) -> dict[str, Any]:
    """One run: per-step losses, the held-out loss, final parameters, momentum bytes, step times."""
    torch.manual_seed(0)
    model = TinyLM(cfg)
    opt = Muon(
        split_params(model, adamw=ADAMW_NAMES, adamw_options=ADAMW),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_dtype=ns_dtype,
        momentum_dtype=momentum_dtype,
    )
    data = tokens(corpus())
    losses, seconds = [], []
    for step in range(1, steps + 1):
        total = 0.0
        for micro in micro_batches(data, step, MICRO, MICRO_SIZE, cfg.seq):
            loss = model.loss(micro)
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        start = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    with torch.no_grad():
        held_out = float(model.loss(batch(data, HELD_OUT_STEP, 64, cfg.seq)))
    muon = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    return {
        "losses": losses,
        "held_out": held_out,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "muon_names": [n for n, p in model.named_parameters() if id(p) in muon],
        "momentum_bytes": opt.memory()["momentum"],
        "step_seconds": statistics.median(seconds),
    }


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> float:
    """||a - b|| / ||b|| over the named tensors together."""
    diff = sum(float((a[n].double() - b[n].double()).square().sum()) for n in names)
    norm = sum(float(b[n].double().square().sum()) for n in names)
    return (diff / norm) ** 0.5


NARROW = {"bf16": torch.bfloat16, "int8": torch.int8}


def drift(run: dict[str, Any], fp32: dict[str, Any]) -> dict[str, Any]:
    """A run's difference from the fp32-momentum run: losses, held-out loss, final parameters."""
    everything = list(fp32["params"])
    return {
        "max_abs_loss_diff": max(abs(a - b) for a, b in zip(fp32["losses"], run["losses"])),
        "param_rel_diff": relative(run["params"], fp32["params"], everything),
        "muon_param_rel_diff": relative(run["params"], fp32["params"], fp32["muon_names"]),
        "held_out_loss": run["held_out"],
        "final_loss": run["losses"][-1],
        "momentum_bytes": run["momentum_bytes"],
        "bytes_ratio": run["momentum_bytes"] / fp32["momentum_bytes"],
        "step_seconds": run["step_seconds"],
        "losses": run["losses"],
    }


def compare(fp32: dict[str, Any], again: dict[str, Any], others: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each of ``others`` (by name) against fp32 momentum, after checking the run is deterministic."""
    if relative(again["params"], fp32["params"], list(fp32["params"])) or again["losses"] != fp32["losses"]:
        raise RuntimeError("two fp32-momentum runs differ: the run is not deterministic here")
    return {"fp32": drift(fp32, fp32)} | {name: drift(run, fp32) for name, run in others.items()}


def table(r: dict[str, Any], other_ns: str) -> str:
    names = [n for n, v in r.items() if isinstance(v, dict) and n != "other_ns"]
    lines = ["| | " + " | ".join(f"{n} momentum" for n in names) + f" | fp32 momentum, NS {other_ns} |"]
    lines.append("|---|" + "---:|" * (len(names) + 1))
    rows = [
        ("momentum state bytes", lambda d: f"{d['momentum_bytes']:,}"),
        ("bytes / fp32 momentum's", lambda d: f"{d['bytes_ratio']:.3f}"),
        ("final step's loss", lambda d: f"{d['final_loss']:.4f}"),
        ("held-out loss after training", lambda d: f"{d['held_out_loss']:.4f}"),
        ("largest \\|loss diff\\| from fp32", lambda d: f"{d['max_abs_loss_diff']:.2e}"),
        ("final parameters, relative diff", lambda d: f"{d['param_rel_diff']:.2e}"),
        ("Muon matrices, relative diff", lambda d: f"{d['muon_param_rel_diff']:.2e}"),
        ("median optimizer step, ms", lambda d: f"{1e3 * d['step_seconds']:.2f}"),
    ]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(r[n]) for n in [*names, "other_ns"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(dim=args.dim, layers=args.layers)
    ns_dtype, why = precision(probe())
    count = sum(p.numel() for p in TinyLM(cfg).parameters())
    print(
        f"TinyLM dim {cfg.dim}, {cfg.layers} layers, {cfg.heads} heads, seq {cfg.seq}: {count:,} parameters; "
        f"{args.steps} steps of {MICRO} x {MICRO_SIZE} sequences; one process, one thread.\n{why}\n",
        flush=True,
    )
    start = time.perf_counter()
    other = "float32" if ns_dtype == "bfloat16" else "bfloat16"
    fp32, again = (train(cfg, args.steps, ns_dtype, None) for _ in range(2))
    others = {name: train(cfg, args.steps, ns_dtype, d) for name, d in NARROW.items()}
    others["other_ns"] = train(cfg, args.steps, other, None)
    result = compare(fp32, again, others) | {"other_ns_dtype": other}
    print(table(result, other))
    print(f"\n5 runs in {time.perf_counter() - start:.1f} s", flush=True)
    out = {
        "config": results_config(args) | {"ns_dtype": ns_dtype, "parameters": count},
        "system": system_info(),
        "result": result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
