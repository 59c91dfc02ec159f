"""Owner-plan balance for Llama-3-8B, Llama-3-70B (and 3.1-405B) hidden matrices at 8 to 1,024 ranks.

For each model and shard-group size N it builds the plan muon_dtensor builds (``build_plan`` over
FSDP2's ``Shard(0)`` blocks, via ``costmodel.sharded_plan``) and prints, as a markdown table:

- **imbalance**: Newton-Schulz flops of the most-loaded rank over the mean (1.00 is perfect);
- **lower bound**: max(largest matrix, mean) / mean. No assignment of whole matrices does better, so
  when it is above 1 the imbalance is unavoidable (more ranks than there is work to split);
- **pigeonhole bound**, tighter: among the j N + 1 costliest matrices some rank gets j + 1, so its
  load is at least the j + 1 cheapest of them (j = 1, 2, ...). Still a lower bound, not the optimum;
- owner traffic per rank (mean, and max over ranks) against 2 S (N-1) / N^2;
- the cost model's owner step on H200s (``Hardware.h200()``, the code as built), for orientation;
- **split** (``ns_split="auto"``): ``planning.split.plan_splits``, the largest
  matrices' Newton-Schulz over k ranks of a node where that pays: how many matrices are split, the
  busiest rank's Newton-Schulz seconds (Gram exchanges and copies included) without and with splits,
  the split plan's imbalance, and the cost model's step with ``predict(..., split=True)``.

Pure arithmetic, no processes: a few seconds. Examples, from the repository root::

    python benchmarks/plan_balance.py
    python benchmarks/plan_balance.py --ranks 8,64 --models llama3-8b
    python benchmarks/plan_balance.py --models llama3-8b,llama3-70b,llama3.1-405b
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from muon_dtensor.numerics.newton_schulz import ns_flops  # noqa: E402
from muon_dtensor.planning.costmodel import (  # noqa: E402
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA31_405B,
    predict,
    sharded_plan,
)
from muon_dtensor.planning.split import plan_splits  # noqa: E402

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama3.1-405b": LLAMA31_405B}
DEFAULT_MODELS = "llama3-8b,llama3-70b"
RANKS = [8, 16, 32, 64, 128, 256, 512, 1024]
BF16_BYTES = 2
TARGET = 1.06  # goal: plan balance <= 1.06x at 8 and 64 ranks
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "plan_balance.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default=",".join(map(str, RANKS)), help="comma-separated group sizes")
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    return p.parse_args(argv)


def pigeonhole_bound(costs: list[int], n: int) -> float:
    """Most-loaded rank's load that no assignment of whole matrices to ``n`` ranks can avoid."""
    c = sorted(costs, reverse=True)
    best = max(c[0], sum(c) / n)
    j = 1
    while j * n + 1 <= len(c):
        top = j * n + 1
        best = max(best, sum(c[top - j - 1 : top]))
        j += 1
    return best


def balance_row(model: str, shapes: list[tuple[int, int]], n: int) -> dict[str, Any]:
    """Balance, its lower bound, traffic and the model's H200 step for one model at ``n`` ranks."""
    plan = sharded_plan(shapes, n)
    mean = sum(plan.loads) / n
    costs = [ns_flops(s) for s in shapes]
    bound = max(max(costs), mean) / mean
    s_bytes = sum(r * c for r, c in shapes) * BF16_BYTES
    sent = [plan.bytes_sent(r, BF16_BYTES) for r in range(n)]
    return {
        "model": model,
        "ranks": n,
        "matrices": len(shapes),
        "imbalance": plan.imbalance,
        "lower_bound": bound,
        "pigeonhole_bound": pigeonhole_bound(costs, n) / mean,
        "bytes_sent_mean": sum(sent) / n,
        "bytes_sent_max": max(sent),
        "owner_formula": 2 * s_bytes * (n - 1) / n**2,
        "predicted_owner_ms_h200": predict(shapes, n).total * 1e3,
    } | split_columns(shapes, n)


def split_columns(shapes: list[tuple[int, int]], n: int) -> dict[str, Any]:
    """The split plan's figures (model): splits, NS seconds without/with, imbalance, step."""
    split, whole = plan_splits(shapes, n), plan_splits(shapes, n, max_k=1)
    return {
        "split_count": split.split_count,
        "split_ks": sorted(set(split.ks) - {1}),
        "whole_ns_ms": whole.makespan * 1e3,
        "split_ns_ms": split.makespan * 1e3,
        "split_imbalance": split.imbalance,
        "predicted_split_ms_h200": predict(shapes, n, split=True).total * 1e3,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | ranks | imbalance (max/mean) | lower bound max(largest, mean)/mean | pigeonhole bound "
        "| owner MB sent/rank (mean / max) | 2S(N-1)/N^2 MB | model: owner step on H200, ms "
        "| split: matrices (k) | split: NS ms whole -> split | split imbalance | model: split step, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['imbalance']:.3f} | {r['lower_bound']:.3f} "
            f"| {r['pigeonhole_bound']:.3f} "
            f"| {r['bytes_sent_mean'] / 1e6:,.0f} / {r['bytes_sent_max'] / 1e6:,.0f} "
            f"| {r['owner_formula'] / 1e6:,.0f} | {r['predicted_owner_ms_h200']:.1f} "
            f"| {r['split_count']} ({','.join(map(str, r['split_ks'])) or '-'}) "
            f"| {r['whole_ns_ms']:.1f} -> {r['split_ns_ms']:.1f} | {r['split_imbalance']:.2f} "
            f"| {r['predicted_split_ms_h200']:.1f} |"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    return {
        f"{r['model']} at {r['ranks']}: imbalance <= {TARGET}": r["imbalance"] <= TARGET
        for r in rows
        if r["ranks"] in (8, 64)
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    rows = [balance_row(m, MODELS[m], n) for m in models for n in ranks]
    print(format_table(rows))
    targets = check_targets(rows)
    if targets:
        verdict = "PASS" if all(targets.values()) else "FAIL"
        print(f"\n{verdict}: " + "; ".join(f"{k}: {'yes' if v else 'no'}" for k, v in targets.items()))
    payload = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rows": rows,
        "targets": targets,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
