"""The pictures of docs/images/, each drawn from a results file under benchmarks/results/.

    python benchmarks/figures.py --results momentum_memory   # (re)write a computed results file
    python benchmarks/figures.py                             # draw every picture (needs matplotlib)

Each picture ``docs/images/<name>.png`` has a sidecar ``docs/images/<name>.json`` with the results
file's path and sha256 and the PNG's sha256; tests/docs/test_figures.py checks both without matplotlib, so
a results file changed without redrawing (or a picture edited by hand) fails. The PNGs are drawn
deterministically (no timestamps in their metadata), so redrawing from the same file gives the same
bytes with the same matplotlib.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
IMAGES = ROOT / "docs" / "images"
RESULTS = ROOT / "benchmarks" / "results"
GPUS = (8, 16, 32, 64, 128, 256)
DTYPES = ("float32", "bfloat16", "int8")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def momentum_memory() -> dict[str, Any]:
    """Muon's momentum bytes on the busiest rank for Llama-3-8B's matrices over FSDP on ``GPUS``, per
    momentum dtype, from the plan ``Muon.memory`` and ``plan --momentum-dtype`` use."""
    from muon_dtensor.planning.cli import MODELS
    from muon_dtensor.planning.plans import rank_memory

    shapes = tuple(MODELS["llama3-8b"])
    table = {
        dtype: {str(g): max(rank_memory(shapes, g, 1, False, None, dtype)[0]) for g in GPUS}
        for dtype in DTYPES
    }
    return {"model": "llama3-8b", "layout": "FSDP over the GPUs", "gpus": list(GPUS), "momentum_bytes": table}


def plan_scaling() -> dict[str, Any]:
    """``plan``'s predicted Muon step for Llama-3-8B and 70B on ``GPUS`` (FSDP, default H200-like
    hardware), and its floor: the Newton-Schulz seconds spread evenly over the ranks (the busiest
    rank's divided by the imbalance), below which no balance of owners can go."""
    from muon_dtensor.planning.cli import parse_args, plan

    out: dict[str, Any] = {"gpus": list(GPUS), "models": {}}
    for model in ("llama3-8b", "llama3-70b"):
        rows = {}
        for g in GPUS:
            p = plan(parse_args(["--model", model, "--gpus", str(g)]))
            rows[str(g)] = {
                "step_ms": p.total * 1e3,
                "newton_schulz_ms": p.newton_schulz * 1e3,
                "floor_ms": p.newton_schulz / p.imbalance * 1e3,
                "comm_ms": p.comm * 1e3,
            }
        out["models"][model] = rows
    return out


COMPUTED: dict[str, Callable[[], dict[str, Any]]] = {
    "momentum_memory": momentum_memory,
    "plan_scaling": plan_scaling,
}


def draw_demo_resume(data: dict[str, Any], plt: Any) -> Any:
    run = data["muon_dtensor"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=[2, 1])
    straight = {int(k): v for k, v in run["losses_uninterrupted"].items()}
    resumed = {int(k): v for k, v in run["losses_resumed"].items()}
    top.plot(list(straight), list(straight.values()), label="uninterrupted", color="tab:blue", lw=2)
    top.plot(list(resumed), list(resumed.values()), "--", label="resumed", color="tab:orange", lw=2)
    top.axvline(int(run["save_at"]), color="gray", ls=":", label=f"saved (step {run['save_at']})")
    top.axvline(int(run["crash_at"]), color="red", ls=":", label=f"crashed (step {run['crash_at']})")
    top.set_ylabel("training loss")
    args = data["args"]
    top.set_title(f"demo: FSDP2 on {args['world_size']} ranks, resumed on {args['resume_world_size']}")
    top.legend()
    diffs = {int(k): v for k, v in run["largest_parameter_difference"].items()}
    floor = 1e-12  # a log axis has no 0: a bitwise step is drawn at the floor
    bottom.semilogy(list(diffs), [max(v, floor) for v in diffs.values()], "o-", color="tab:green", ms=3)
    bottom.set_ylim(floor / 10, 1)
    bottom.set_ylabel("max |param diff|")
    bottom.set_xlabel("step")
    bottom.text(0.01, 0.1, f"at {floor:g}: bitwise equal", transform=bottom.transAxes, fontsize=8)
    return fig


def draw_momentum_memory(data: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = data["gpus"]
    for dtype, marker in zip(DTYPES, "osd"):
        values = [data["momentum_bytes"][dtype][str(g)] / 2**20 for g in gpus]
        ax.loglog(gpus, values, marker + "-", label=f"{dtype} momentum", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ticks = [32, 64, 128, 256, 512, 1024, 2048, 4096]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("GPUs (FSDP)")
    ax.set_ylabel("Muon momentum per rank (MiB, busiest rank)")
    ax.set_title(f"{data['model']}: momentum memory per rank (plan --momentum-dtype)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def draw_plan_scaling(data: dict[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gpus = data["gpus"]
    for (model, rows), color in zip(data["models"].items(), ("tab:blue", "tab:red")):
        ax.loglog(
            gpus, [rows[str(g)]["step_ms"] for g in gpus], "o-", color=color, label=f"{model}: step", base=2
        )
        floor = [rows[str(g)]["floor_ms"] for g in gpus]
        ax.loglog(gpus, floor, "--", color=color, label=f"{model}: FLOP floor", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ticks = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("GPUs (FSDP)")
    ax.set_ylabel("Muon step (ms, predicted)")
    ax.set_title("plan: Muon step against GPUs (H200 defaults)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_muon_vs_adamw(data: dict[str, Any], plt: Any) -> Any:
    """train_benefit.json: val loss against steps and tokens at each arm's best lr (mean, band from the
    lowest to the highest of the seeds), and the final val loss against lr (seed 0)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    summary, setup = data["summary"], data["protocol"]["setup"]
    tokens = setup["batch"] * setup["seq"]
    for arm, color in ARM_COLORS.items():
        curves = _curves(data["runs"], arm, summary["best_lr"][arm], data["protocol"]["steps"])
        if not curves:
            continue
        steps = [p["step"] for p in curves[0]]
        vals = [[c[i]["val_loss"] for c in curves] for i in range(len(steps))]
        mean = [sum(v) / len(v) for v in vals]
        label = f"{arm} lr {summary['best_lr'][arm]:g} ({len(curves)} seed{'s' * (len(curves) > 1)})"
        left.plot(steps, mean, "-", color=color, label=label, lw=1.8)
        left.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.25)
    left.set_xlabel(f"step (x {tokens:,} tokens)")
    left.set_ylabel("held-out val loss (nats per byte, 128 windows)")
    left.set_title("Hamlet + The Tempest held out: mean and range over seeds", fontsize=10, pad=30)
    top = left.secondary_xaxis("top", functions=(lambda s: s * tokens / 1e3, lambda t: t * 1e3 / tokens))
    top.set_xlabel("thousands of tokens")
    for arm, color in ARM_COLORS.items():
        grid = sorted(
            (r["settings"]["lr"], r["final_val_loss"]) for r in data["runs"] if _is(r, arm, 0, data)
        )
        right.semilogx([g[0] for g in grid], [g[1] for g in grid], "o-", color=color, label=arm, base=2)
    tried = sorted({r["settings"]["lr"] for r in data["runs"]})
    right.set_xticks(tried, [f"{lr:g}" for lr in tried], rotation=45, fontsize=7)
    right.minorticks_off()
    right.set_xlabel("learning rate of the hidden matrices (seed 0)")
    right.set_ylabel("final val loss (1,024 windows)")
    right.set_title(f"the sweep; verdict: {summary.get('verdict', 'incomplete')}", fontsize=10)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return fig


ARM_COLORS = {"muon": "tab:blue", "adamw": "tab:gray"}


def _is(run: dict[str, Any], arm: str, seed: int, data: dict[str, Any]) -> bool:
    s = run["settings"]
    return bool(s["optimizer"] == arm and s["seed"] == seed and s["steps"] == data["protocol"]["steps"])


def _curves(
    runs: list[dict[str, Any]], arm: str, lr: float | None, steps: int
) -> list[list[dict[str, float]]]:
    s = [
        r
        for r in runs
        if (r["settings"]["optimizer"], r["settings"]["lr"], r["settings"]["steps"]) == (arm, lr, steps)
    ]
    return [r["curve"] for r in sorted(s, key=lambda r: r["settings"]["seed"])]


# The published costs of Muon's step (issue #47, each from its source): share of a step or step-time increase.
PUBLISHED = [
    ("modded-nanogpt speedrun (<2% wall)", 2.0),
    ("Kimi K2, 256 GB300 (-2.1% TFLOP/s)", 2.1),
    ("modded-nanogpt (+2.5% step)", 2.5),
    ("modded-nanogpt (+3.8% step)", 3.8),
    ("dion on FSDP2, 1B, 8 B200 (5.5-5.8%)", 5.65),
    ("Marin (+5-7% training time)", 6.0),
]


def draw_step_share(data: dict[str, Any], plt: Any) -> Any:
    """step_share_measured.json: measured and predicted shares here, the model's H200 predictions and
    the published figures, as one bar chart of percentages (log scale)."""
    bars: list[tuple[str, float, str]] = []
    for r in data["rows"]:
        t = f"{r['tokens']:,} tok"
        bars.append((f"measured here: Muon, 2 CPU ranks, {t}", 100 * r["muon_share"], "tab:blue"))
        bars.append((f"predicted (FLOPs): Muon, {t}", 100 * r["predicted_muon_share"], "tab:cyan"))
        bars.append((f"measured here: AdamW, {t}", 100 * r["adamw_share"], "tab:gray"))
    for r in data.get("h200_predicted", []):
        bars.append(
            (
                f"cost model: {r['model']}, {r['gpus']} H200, {r['tokens'] / 1e6:g}M tok",
                100 * r["muon_share"],
                "tab:purple",
            )
        )
    bars += [(f"published: {name}", value, "tab:orange") for name, value in PUBLISHED]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.2))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    for i, b in enumerate(bars):
        ax.text(b[1], i, f" {b[1]:.2g}%", va="center", fontsize=7)
    ax.set_xlabel("optimizer share of a training step (%)")
    cfg = data["config"]
    ax.set_title(
        f"Muon's share of a step: width {cfg['width']}, {cfg['layers']} layers here; H200 by the cost model",
        fontsize=10,
    )
    ax.grid(True, axis="x", alpha=0.3)
    return fig


FIGURES: dict[str, tuple[str, Callable[[dict[str, Any], Any], Any]]] = {
    "muon_vs_adamw": ("train_benefit.json", draw_muon_vs_adamw),
    "step_share": ("step_share_measured.json", draw_step_share),
    "plan_scaling": ("figure_plan_scaling.json", draw_plan_scaling),
    "demo_resume": ("demo_fsdp_2to1.json", draw_demo_resume),
    "momentum_memory": ("figure_momentum_memory.json", draw_momentum_memory),
}


def draw(name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, fn = FIGURES[name]
    source = RESULTS / results
    plt.rcParams["svg.hashsalt"] = "figures"
    fig = fn(json.loads(source.read_text()), plt)
    fig.tight_layout()
    IMAGES.mkdir(parents=True, exist_ok=True)
    png = IMAGES / f"{name}.png"
    fig.savefig(png, dpi=100, metadata={"Software": None, "Results-sha256": sha256(source)})
    plt.close(fig)
    sidecar = {
        "results": f"benchmarks/results/{results}",
        "results_sha256": sha256(source),
        "png_sha256": sha256(png),
        "script": "benchmarks/figures.py",
        "matplotlib": matplotlib.__version__,
    }
    (IMAGES / f"{name}.json").write_text(json.dumps(sidecar, indent=2) + "\n")
    print(f"{png.relative_to(ROOT)} from {sidecar['results']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", choices=sorted(COMPUTED), help="write this computed results file and exit")
    p.add_argument("names", nargs="*", choices=[[], *sorted(FIGURES)], help="pictures to draw (default: all)")
    args = p.parse_args(argv)
    if args.results:
        out = RESULTS / FIGURES[args.results][0]
        out.write_text(json.dumps(COMPUTED[args.results](), indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
        return 0
    for name in args.names or sorted(FIGURES):
        draw(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
