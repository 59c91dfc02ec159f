"""What the demo prints and writes: the step table, checkpoint files per rank, the verdict, the plot.

Pure functions of the runs' results (``train.train``'s dicts), so they run in the parent process.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TOLERANCE",
    "Outcome",
    "checkpoint_table",
    "contrast_table",
    "ranks",
    "largest_difference",
    "plot",
    "step_table",
    "verdict",
]

# Largest parameter difference a resumed run may show against the uninterrupted one. A resume on
# the same layout, or from 2 ranks to 1, is bitwise (difference 0): every micro-batch's gradient is
# computed alike, scalings are powers of two, and a sum of two does not depend on its order. Across
# other world sizes and with tensor parallelism the reduction order changes, and bfloat16
# Newton-Schulz amplifies last-bit differences: measured 4e-3 after 10 steps from 2 to 4 ranks,
# 6e-3 after 20 steps of fsdp-tp from 2 ranks to 1. Losing momentum, as round-robin Muon does,
# moved parameters by 5e-2 in 10 steps. The amplification grows with the run: 1e-2 after 50 steps
# from 2 to 4 ranks, hence the demo's --tolerance for long runs.
TOLERANCE = 1e-2
DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class Outcome:
    """One optimizer's crash-and-resume: the uninterrupted run, the resumed run, where it broke."""

    straight: dict[str, Any]
    resumed: dict[str, Any]
    save_at: int
    crash_at: int

    @property
    def last(self) -> int:
        return max(self.straight["losses"])

    def difference(self, step: int) -> float:
        return largest_difference(self.straight["params"][step], self.resumed["params"][step])


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _fmt_diff(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def _rows(first: int, last: int, most: int = 12) -> list[int]:
    stride = max(1, -(-(last - first) // most))
    return sorted(set(range(first, last + 1, stride)) | {last})


def step_table(outcome: Outcome, world: int, resume_world: int) -> str:
    head = (
        f"| step | loss, uninterrupted ({ranks(world)}) | loss, resumed ({ranks(resume_world)}) "
        "| largest parameter difference |\n|---:|---:|---:|---:|"
    )
    lines = [head]
    for step in _rows(outcome.save_at, outcome.last):
        ours = outcome.straight["losses"][step]
        theirs = outcome.resumed["losses"].get(step)
        label = f"{step} (checkpoint)" if step == outcome.save_at else str(step)
        resumed = "loaded" if theirs is None else f"{theirs:.4f}"
        lines.append(f"| {label} | {ours:.4f} | {resumed} | {_fmt_diff(outcome.difference(step))} |")
    return "\n".join(lines)


def checkpoint_table(folder: Path) -> str:
    """Files and bytes each rank wrote, from the step folder's manifest.json."""
    manifest = json.loads((folder / "manifest.json").read_text())
    per_rank: dict[int, list[tuple[str, int]]] = {}
    for name, record in manifest["files"].items():
        match = DISTCP.match(name)
        per_rank.setdefault(int(match.group(1)) if match else 0, []).append((name, record["bytes"]))
    per_rank[0].append(("manifest.json", (folder / "manifest.json").stat().st_size))
    lines = ["| rank | files | bytes |", "|---:|---|---:|"]
    for rank in sorted(per_rank):
        files = sorted(per_rank[rank], key=lambda f: not f[0].startswith("__"))
        lines.append(f"| {rank} | {', '.join(n for n, _ in files)} | {sum(b for _, b in files):,} |")
    total = sum(b for files in per_rank.values() for _, b in files)
    lines.append(f"| all | {sum(len(f) for f in per_rank.values())} files | {total:,} |")
    return "\n".join(lines)


def contrast_table(ours: Outcome, theirs: Outcome, ours_bytes: int, theirs_bytes: int) -> str:
    last = ours.last
    rows = [
        (
            "checkpoint",
            f"DCP, every rank its shards: {ours_bytes:,} bytes",
            f"torch.save on rank 0: {theirs_bytes:,} bytes",
        ),
        (
            "momentum buffers restored",
            "{} of {}".format(*ours.resumed["kept"]),
            "{} of {}".format(*theirs.resumed["kept"]),
        ),
        (
            f"loss at step {last}, uninterrupted",
            f"{ours.straight['losses'][last]:.4f}",
            f"{theirs.straight['losses'][last]:.4f}",
        ),
        (
            f"loss at step {last}, resumed",
            f"{ours.resumed['losses'][last]:.4f}",
            f"{theirs.resumed['losses'][last]:.4f}",
        ),
        (
            f"largest parameter difference at step {last}",
            _fmt_diff(ours.difference(last)),
            _fmt_diff(theirs.difference(last)),
        ),
    ]
    return "\n".join(
        ["| | muon_dtensor | round-robin Muon |", "|---|---|---|"]
        + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    )


def verdict(
    outcome: Outcome, world: int, resume_world: int, tolerance: float = TOLERANCE
) -> tuple[bool, str]:
    """PASS when the resumed run stays within ``tolerance`` of the uninterrupted one at every step,
    every momentum buffer came back, and the loss fell by at least 10%."""
    gap = max(outcome.difference(step) for step in outcome.resumed["params"])
    kept, total = outcome.resumed["kept"]
    first, final = outcome.straight["losses"][1], outcome.resumed["losses"][outcome.last]
    tracks, fell = gap <= tolerance, final < 0.9 * first
    if tracks:
        how = "bitwise equal" if gap == 0 else f"tolerance {tolerance:.0e}"
        track = f"tracks the uninterrupted one within float tolerance (largest parameter difference {_fmt_diff(gap)}, {how})"
    else:
        track = (
            f"does NOT track the uninterrupted one (largest parameter difference {gap:.1e} > {tolerance:.0e})"
        )
    parts = [
        f"resumed on {ranks(resume_world)} from a {world}-rank checkpoint, the run {track}",
        f"{kept} of {total} momentum buffers restored",
        f"loss {'fell' if fell else 'did NOT fall'} from {first:.2f} to {final:.2f}",
    ]
    ok = tracks and fell and kept == total
    return ok, f"verdict: {'PASS' if ok else 'FAIL'}: " + "; ".join(parts)


def _loss_panel(axis: Any, name: str, outcome: Outcome, color: str) -> None:
    steps = sorted(outcome.straight["losses"])
    axis.plot(steps, [outcome.straight["losses"][s] for s in steps], color="black", label="uninterrupted")
    resumed = sorted(outcome.resumed["losses"])
    losses = [outcome.resumed["losses"][s] for s in resumed]
    axis.plot(resumed, losses, "--", color=color, linewidth=2, label="crashed and resumed")
    axis.set_title(f"{name}: training loss")
    axis.set_ylabel("loss")


def plot(ours: Outcome, theirs: Outcome, path: Path) -> Path | None:
    """Loss curves and parameter differences as a PNG, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    runs = (("muon_dtensor", ours, "tab:blue"), ("round-robin Muon", theirs, "tab:red"))
    for axis, (name, outcome, color) in zip(axes[:2], runs, strict=True):
        _loss_panel(axis, name, outcome, color)
    for name, outcome, color in runs:
        after = sorted(outcome.resumed["params"])
        # log scale: a bitwise-equal run (difference 0) is drawn at 1e-9
        axes[2].plot(after, [max(outcome.difference(s), 1e-9) for s in after], "o-", color=color, label=name)
    axes[2].set_yscale("log")
    axes[2].set_title("resumed vs uninterrupted: largest parameter difference")
    axes[2].set_ylabel("(0 drawn at 1e-9)")
    for axis in axes:
        axis.axvline(ours.save_at, color="gray", linestyle=":", label="checkpoint")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("step")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
