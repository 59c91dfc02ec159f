"""The cost model's Muon step for Llama-3 hidden matrices on H200s (the package's goals), with what-ifs.

Prints, for Llama-3-8B (and 70B) at the chosen shard-group sizes, the predicted owner-mode step of
the code as built (multi-tensor elementwise ops, exchange rounds of 4 MiB pipelined with
Newton-Schulz), the same step in one round (no overlap), gather mode and redundant Newton-Schulz,
then fused elementwise kernels (not built) and pessimistic hardware figures. Goals:
Llama-3-8B <= 130 ms on 8 H200s and <= 25 ms on 64; redundant Newton-Schulz is about 843 ms at any
size. For one model and layout at a time, ``python -m muon_dtensor plan`` prints the same model.

HSDP: for each ``--hsdp`` layout (shards x replicas, default 8x8: 64 H200s, a shard
group per node), owners per replica (every replica orthogonalizes every matrix: the step of one
shard group), owners over the mesh (each matrix once in the mesh, results sent across nodes), the
choice of ``owners="auto"``, and what-ifs. Goal: Llama-3-8B on 8x8 <= 30 ms.

Split (``ns_split="auto"``): every owner-mode row has a twin with the largest
matrices' Newton-Schulz run over k ranks of a node where that pays (``predict(..., split=True)``,
``planning/split.py``). ``--grid`` prints the table of docs/benchmarks.md section 8: Llama-3-8B,
70B and 3.1-405B at 8, 64, 256 and 1,024 H200s, FSDP and 8-way shard x R HSDP (owners per replica
and over the mesh), standard and split. Goals: Llama-3-70B at 1,024 <= 40 ms,
Llama-3-8B falling with ranks up to 1,024.

Pure arithmetic (muon_dtensor/planning/costmodel.py); no GPU needed. Examples, from the repository root::

    python benchmarks/predict_h200.py
    python benchmarks/predict_h200.py --ranks 8,16,32,64 --models llama3-8b,llama3-70b --hsdp 8x8,8x4
    python benchmarks/predict_h200.py --grid   # a few minutes: 72 predictions, up to 1,024 ranks
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from muon_dtensor.planning.costmodel import (  # noqa: E402
    CURRENT,
    FUSED,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA31_405B,
    Hardware,
    Implementation,
    predict,
)

MODELS = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama3.1-405b": LLAMA31_405B}
GOALS_MS = {
    ("llama3-8b", 8): 130.0,
    ("llama3-8b", 64): 25.0,
    ("llama3-8b", "8x8"): 30.0,
    ("llama3-70b", 1024): 40.0,
}
GRID_MODELS = ("llama3-8b", "llama3-70b", "llama3.1-405b")
GRID_GPUS = (8, 64, 256, 1024)
SPLIT_LABEL = "owner + split (ns_split=auto)"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "predict_h200.json"
# Pessimistic figures: NS at ~60% of the datasheet's 989 TFLOP/s, links at 70% of peak, 10 us per op.
PESSIMISTIC = Hardware.h200(
    matmul_flops=600e12, intra_node_bandwidth=0.7 * 450e9, inter_node_bandwidth=0.7 * 50e9, op_overhead=10e-6
)
# (label, mode, implementation, hardware)
CASES: list[tuple[str, str, Implementation, Hardware]] = [
    ("owner, as built", "owner", CURRENT, Hardware.h200()),
    (
        "owner, one round (max_round_bytes=None)",
        "owner",
        replace(CURRENT, max_round_bytes=None),
        Hardware.h200(),
    ),
    ("gather, as built", "gather", CURRENT, Hardware.h200()),
    ("redundant Newton-Schulz only", "redundant", CURRENT, Hardware.h200()),
    ("owner + fused elementwise (not built)", "owner", FUSED, Hardware.h200()),
    ("owner, as built, pessimistic hardware", "owner", CURRENT, PESSIMISTIC),
    ("owner + fused, pessimistic hardware", "owner", FUSED, PESSIMISTIC),
]
# HSDP: (label, owners, implementation, hardware)
HSDP_CASES: list[tuple[str, str, Implementation, Hardware]] = [
    ('owners="replica" (before)', "replica", CURRENT, Hardware.h200()),
    ('owners="mesh", as built', "mesh", CURRENT, Hardware.h200()),
    ('owners="auto" picks', "auto", CURRENT, Hardware.h200()),
    ('owners="mesh", one round', "mesh", replace(CURRENT, max_round_bytes=None), Hardware.h200()),
    ('owners="mesh" + fused elementwise (not built)', "mesh", FUSED, Hardware.h200()),
    ('owners="mesh", pessimistic hardware', "mesh", CURRENT, PESSIMISTIC),
    ('owners="replica", pessimistic hardware', "replica", CURRENT, PESSIMISTIC),
    ('owners="mesh" + split (ns_split=auto)', "mesh+split", CURRENT, Hardware.h200()),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="8,64", help="comma-separated shard-group sizes (8,64)")
    p.add_argument("--models", default="llama3-8b,llama3-70b", help=f"of {sorted(MODELS)}")
    p.add_argument("--hsdp", default="8x8", help="comma-separated shards x replicas layouts (8x8)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    p.add_argument("--grid", action="store_true", help="also the model x GPUs x layout x split grid")
    return p.parse_args(argv)


def rows_for(model: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for label, mode, impl, hw in CASES:
        p = predict(MODELS[model], n, hw, mode=mode, impl=impl)
        goal = GOALS_MS.get((model, n))
        rows.append(
            {"model": model, "ranks": n, "case": label, "goal_ms": goal, "prediction": asdict(p)}
            | {"meets_goal": None if goal is None or mode != "owner" else p.total * 1e3 <= goal}
        )
    p = predict(MODELS[model], n, split=True)
    goal = GOALS_MS.get((model, n))
    rows.append(
        {"model": model, "ranks": n, "case": SPLIT_LABEL, "goal_ms": goal, "prediction": asdict(p)}
        | {"meets_goal": None if goal is None else p.total * 1e3 <= goal}
    )
    return rows


def grid_rows() -> list[dict[str, Any]]:
    """Section 8's table: each model at each GPU count as FSDP and as 8 x R HSDP, per replica and
    over the mesh, standard and split (8 GPUs: one shard group, HSDP is FSDP)."""
    rows = []
    for model in GRID_MODELS:
        for gpus in GRID_GPUS:
            layouts = [("FSDP", gpus, 1, "replica")]
            if gpus > 8:
                layouts += [(f"HSDP 8x{gpus // 8}", 8, gpus // 8, o) for o in ("replica", "mesh")]
            for layout, shards, replicas, owners in layouts:
                std, split = (
                    predict(MODELS[model], shards, replicas=replicas, owners=owners, split=s)
                    for s in (False, True)
                )
                rows.append(
                    {"model": model, "gpus": gpus, "layout": layout, "owners": owners}
                    | {"standard": asdict(std), "split": asdict(split)}
                )
    return rows


def format_grid(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | H200s | layout | owners | standard: step ms (NS, comm) | split: step ms (NS, comm) "
        "| imbalance standard -> split |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        a, b = r["standard"], r["split"]
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['layout']} | {r['owners']} "
            f"| {a['total'] * 1e3:.1f} ({a['newton_schulz'] * 1e3:.1f}, {a['comm'] * 1e3:.1f}) "
            f"| {b['total'] * 1e3:.1f} ({b['newton_schulz'] * 1e3:.1f}, {b['comm'] * 1e3:.1f}) "
            f"| {a['imbalance']:.2f} -> {b['imbalance']:.2f} |"
        )
    return "\n".join(lines)


def hsdp_rows(model: str, layout: str) -> list[dict[str, Any]]:
    shards, replicas = (int(v) for v in layout.split("x"))
    rows = []
    for label, owners, impl, hw in HSDP_CASES:
        chosen, split = owners.removesuffix("+split"), owners.endswith("+split")
        p = predict(MODELS[model], shards, hw, impl=impl, replicas=replicas, owners=chosen, split=split)
        goal = GOALS_MS.get((model, layout))
        case = f"HSDP {layout}, {label}" + (f": {p.owners}" if owners == "auto" else "")
        rows.append(
            {"model": model, "ranks": f"{shards * replicas} ({layout})", "case": case, "goal_ms": goal}
            | {"prediction": asdict(p), "meets_goal": None if goal is None else p.total * 1e3 <= goal}
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | H200s | case | step ms | NS ms | comm ms | memory ms | host ms | goal |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p = r["prediction"]
        goal = (
            "" if r["meets_goal"] is None else f"<= {r['goal_ms']:.0f}: {'yes' if r['meets_goal'] else 'no'}"
        )
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['case']} | {p['total'] * 1e3:.1f} | {p['newton_schulz'] * 1e3:.1f} "
            f"| {p['comm'] * 1e3:.1f} | {p['memory'] * 1e3:.1f} | {p['host'] * 1e3:.1f} | {goal} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [
        r for m in args.models.split(",") for n in map(int, args.ranks.split(",")) for r in rows_for(m, n)
    ]
    rows += [
        r for m in args.models.split(",") for lay in args.hsdp.split(",") if lay for r in hsdp_rows(m, lay)
    ]
    print("defaults: " + ", ".join(f"{k}={v:g}" for k, v in asdict(Hardware.h200()).items()))
    print(format_table(rows))
    payload = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware_default": asdict(Hardware.h200()),
        "hardware_pessimistic": asdict(PESSIMISTIC),
        "rows": rows,
    }
    if args.grid:
        payload["grid"] = grid_rows()
        print(format_grid(payload["grid"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
