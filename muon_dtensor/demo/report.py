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
    "lessons",
    "ranks",
    "largest_difference",
    "plot",
    "step_table",
    "twin_table",
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

    def left_twin_at(self) -> int | None:
        """The first step at which the resumed run's parameters differ from its twin's, or None."""
        return next((s for s in sorted(self.resumed["params"]) if self.difference(s) > 0), None)


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
        f"| step | loss, uninterrupted twin ({ranks(world)}) | loss, resumed ({ranks(resume_world)}) "
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


def _left(outcome: Outcome) -> str:
    step = outcome.left_twin_at()
    if step is None:
        return f"never: bitwise equal through step {outcome.last}"
    first = " (the first step after the resume)" if step == outcome.save_at + 1 else ""
    return f"at step {step}{first}, by {_fmt_diff(outcome.difference(step))}"


def twin_table(ours: Outcome, theirs: Outcome, ours_bytes: int, theirs_bytes: int) -> str:
    """Each optimizer's resumed run against its own uninterrupted twin, side by side."""
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
        ("resumed run leaves its twin", _left(ours), _left(theirs)),
        (
            f"largest parameter difference from its twin at step {last}",
            _fmt_diff(ours.difference(last)),
            _fmt_diff(theirs.difference(last)),
        ),
        (f"loss at step {last}: twin, resumed", _losses(ours, last), _losses(theirs, last)),
    ]
    return "\n".join(
        [
            "| each resumed run against its own uninterrupted twin | muon_dtensor | round-robin Muon |",
            "|---|---|---|",
        ]
        + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    )


def _losses(outcome: Outcome, step: int) -> str:
    return f"{outcome.straight['losses'][step]:.4f}, {outcome.resumed['losses'][step]:.4f}"


def lessons(ours: Outcome, theirs: Outcome, world: int, resume_world: int) -> list[str]:
    """What an exact resume buys, in the terms of these runs: reproducibility, debuggability, and
    why the round-robin run's loss says nothing. One line each."""
    last, left = ours.last, theirs.left_twin_at()
    probe = (ours.crash_at + last + 1) // 2  # a step after the crash, where a fault might be chased
    gone = f"another run from step {left} on" if left is not None else "its twin (it lost nothing)"
    exact = ours.left_twin_at() is None
    if exact:
        ours_is = (
            f"its twin bit for bit (here on {ranks(resume_world)}, the twin on {world}): a crash leaves no trace in "
            "the numbers"
        )
        replay = f"(here on {ranks(resume_world)}) and shows up again at step {probe}, bit for bit"
    else:
        ours_is = (
            f"within float rounding of its twin (parameter difference {_fmt_diff(ours.difference(last))} at step {last}: "
            f"{ranks(resume_world)} sum in another order than {world}); on the same world size, its twin bit for bit"
        )
        replay = (
            f"and shows up again at step {probe}: bit for bit on the same world size, here on "
            f"{ranks(resume_world)} within {_fmt_diff(ours.difference(probe))}"
        )
    return [
        f"- reproducible: muon_dtensor's resumed run is {ours_is}. Round-robin's resumed run is {gone}.",
        f"- debuggable: a loss spike or NaN at step {probe} replays from the step-{ours.save_at} checkpoint {replay}; "
        "after round-robin's resume the replay is not the run that failed (parameters "
        f"{_fmt_diff(theirs.difference(probe))} apart by step {probe}).",
        f"- why round-robin's {_versus(theirs, last)} loss says nothing: losing momentum changed the recipe mid-run, "
        f"and which recipe is ahead after {last} steps of a toy model predicts nothing about a real run; a resume "
        "must continue the run you chose.",
    ]


def _versus(outcome: Outcome, step: int) -> str:
    twin, resumed = outcome.straight["losses"][step], outcome.resumed["losses"][step]
    return "lower" if resumed < twin else "higher" if resumed > twin else "equal"


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
        track = f"tracks its uninterrupted twin within float tolerance (largest parameter difference {_fmt_diff(gap)}, {how})"
    else:
        track = f"does NOT track its uninterrupted twin (largest parameter difference {gap:.1e} > {tolerance:.0e})"
    parts = [
        f"resumed on {ranks(resume_world)} from a {world}-rank checkpoint, the run {track}",
        f"{kept} of {total} momentum buffers restored",
        f"loss {'fell' if fell else 'did NOT fall'} from {first:.2f} to {final:.2f}",
    ]
    ok = tracks and fell and kept == total
    return ok, f"verdict: {'PASS' if ok else 'FAIL'}: " + "; ".join(parts)


def _loss_panel(axis: Any, name: str, outcome: Outcome, color: str) -> None:
    steps = sorted(outcome.straight["losses"])
    axis.plot(
        steps, [outcome.straight["losses"][s] for s in steps], color="black", label="uninterrupted twin"
    )
    resumed = sorted(outcome.resumed["losses"])
    losses = [outcome.resumed["losses"][s] for s in resumed]
    axis.plot(resumed, losses, "--", color=color, linewidth=2, label="killed and resumed")
    axis.set_title(f"{name}: resumed run and its twin")
    axis.set_ylabel("training loss")


FLOOR = 1e-9  # where a difference of 0 (bitwise equal) is drawn on the log axis


def _difference_panel(axis: Any, runs: tuple[tuple[str, Outcome, str], ...]) -> None:
    for name, outcome, color in runs:
        after = sorted(outcome.resumed["params"])
        diffs = [outcome.difference(s) for s in after]
        label = f"{name} (0: bitwise equal)" if not any(diffs) else name
        axis.plot(after, [max(d, FLOOR) for d in diffs], "o-", color=color, label=label)
    axis.set_yscale("log")
    axis.set_ylim(FLOOR / 10, 1)
    axis.set_title("resumed run vs its twin: parameters")
    axis.set_ylabel("largest parameter difference\n(log scale; 0 drawn at 1e-9)")


def plot(ours: Outcome, theirs: Outcome, path: Path) -> Path | None:
    """Loss curves and parameter differences as a PNG, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), layout="constrained")
    runs = (("muon_dtensor", ours, "tab:blue"), ("round-robin Muon", theirs, "tab:red"))
    for axis, (name, outcome, color) in zip(axes[:2], runs, strict=True):
        _loss_panel(axis, name, outcome, color)
    _difference_panel(axes[2], runs)
    for axis in axes:
        axis.axvline(ours.save_at, color="gray", linestyle=":", label="checkpoint")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("step")
        axis.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
