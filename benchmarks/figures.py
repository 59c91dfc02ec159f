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
    from muon_dtensor.planning.plans import rank_memory
    from muon_dtensor.tools.plan_command import MODELS

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
    from muon_dtensor.tools.plan_command import parse_args, plan

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


STEPS = 40  # the demo's default


def train_losses(optimizer: str, folder: str) -> dict[str, float]:
    """Rank function: the demo's model, data and FSDP2 layout (muon_dtensor.demo), ``STEPS`` steps with
    the demo's Muon (Muon for the matrices, AdamW for the rest), or AdamW for every parameter at the
    demo's AdamW settings; the global mean loss of each step."""
    import torch

    from muon_dtensor import Muon
    from muon_dtensor.demo.data import corpus, tokens
    from muon_dtensor.demo.model import TinyLM
    from muon_dtensor.demo.run import BATCH
    from muon_dtensor.demo.train import ADAMW, RunSpec, ShardedSession, train_step

    torch.manual_seed(0)
    session = ShardedSession(
        TinyLM(RunSpec("muon_dtensor", "fsdp", STEPS, 2, BATCH // 2, folder).model), "fsdp"
    )
    if optimizer == "adamw":
        named = list(session.model.named_parameters())
        session.opt = Muon([{"params": named, "algorithm": "adamw", **ADAMW}])
    spec = RunSpec("muon_dtensor", "fsdp", STEPS, 2, BATCH // 2, folder)
    data = tokens(corpus())
    return {str(step): train_step(session, data, step, spec) for step in range(1, STEPS + 1)}


def muon_vs_adamw() -> dict[str, Any]:
    """The demo's task at equal steps: Muon and AdamW, in one process and on 2 FSDP2 ranks (gloo)."""
    import tempfile

    import torch

    from muon_dtensor.testing import run_ranks

    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in (1, 2):
            for optimizer in ("muon", "adamw"):
                runs[f"{optimizer}, {world} rank{'s' if world > 1 else ''}"] = run_ranks(
                    train_losses, world, optimizer, folder, timeout=600
                )[0]
    return {"steps": STEPS, "torch": torch.__version__, "runs": runs}


COMPUTED: dict[str, Callable[[], dict[str, Any]]] = {
    "muon_vs_adamw": muon_vs_adamw,
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
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"muon": "tab:blue", "adamw": "tab:gray"}
    for label, losses in data["runs"].items():
        steps = [int(k) for k in losses]
        style = "-" if label.endswith(" 1 rank") else "o"  # 2 ranks: markers, on the one-process line
        ax.plot(
            steps, list(losses.values()), style, color=styles[label.split(",")[0]], label=label, lw=1.5, ms=3
        )
    ax.set_xlabel("step (markers: the 2-rank runs, on the one-process lines)")
    ax.set_ylabel("training loss")
    ax.set_title("the demo's task: Muon against AdamW at equal steps (one process and 2-rank FSDP2)")
    ax.title.set_fontsize(10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


FIGURES: dict[str, tuple[str, Callable[[dict[str, Any], Any], Any]]] = {
    "muon_vs_adamw": ("figure_muon_vs_adamw.json", draw_muon_vs_adamw),
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
