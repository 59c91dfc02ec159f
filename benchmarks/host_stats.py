"""Step times as a median with its spread, and paired ratios, for ``bench_host.py``.

On a shared machine one step's time says little: another process takes the core for a while and
every contender stepping then is slower. So the contenders step in interleaved rounds (one step
each, the order rotated every round), each round's ratio to the reference is taken within the
round, and the table gives medians with the 25th and 75th percentiles beside them. Two clocks:
wall time of a barrier-started step on its slowest rank (what a training loop waits for) and the
CPU time of each rank's main thread during the step (``time.thread_time``: the host's own work,
which does not count the time the thread waited for a core or for a collective).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "format_depth",
    "format_timed",
    "paired_ratios",
    "per_layer",
    "rotated",
    "spread",
    "spread_text",
    "summarize",
]


def rotated(labels: Sequence[str], round_index: int) -> list[str]:
    """The contenders' order in round ``round_index``: each starts a round in turn, so none always
    steps right after the same neighbour (whose caches and freed memory it would inherit)."""
    k = round_index % len(labels)
    return [*labels[k:], *labels[:k]]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    x = q * (len(sorted_values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, 25th and 75th percentiles, min and max of ``values``."""
    s = sorted(values)
    return {
        "median": statistics.median(s),
        "p25": _quantile(s, 0.25),
        "p75": _quantile(s, 0.75),
        "min": s[0],
        "max": s[-1],
        "n": len(s),
    }


def paired_ratios(values: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Round by round, ``values[r] / reference[r]``: both stepped in the same round, under the same load."""
    return [v / r for v, r in zip(values, reference, strict=True)]


def spread_text(s: dict[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """``median [p25-p75]`` of a ``spread`` result, each value times ``scale``."""
    return f"{s['median'] * scale:.{digits}f} [{s['p25'] * scale:.{digits}f}-{s['p75'] * scale:.{digits}f}]"


def summarize(
    per_rank: list[dict[int, dict[str, Any]]], ranks: int, labels: Sequence[str], reference: str
) -> list[dict[str, Any]]:
    """Rows (contender, ranks, layers): counts of the rank with most ops; per step the slowest
    rank's wall time and the busiest rank's main-thread CPU time, as medians with their spread
    (``spread``), and each round's ratio to the ``reference`` contender's step of the same round."""
    rows = []
    for layers in per_rank[0]:
        wall = {
            label: [max(t) for t in zip(*(r[layers][label]["times"] for r in per_rank), strict=True)]
            for label in labels
        }
        cpu = {
            label: [max(t) for t in zip(*(r[layers][label]["cpu_times"] for r in per_rank), strict=True)]
            for label in labels
        }
        for label in labels:
            at = [r[layers][label] for r in per_rank]
            busiest = max(at, key=lambda c: c.get("ops") or 0)
            rows.append(
                {"contender": label, "ranks": ranks, "layers": layers, "ops": busiest.get("ops")}
                | {"ops_each_rank": [c.get("ops") for c in at], "collectives": busiest.get("collectives")}
                | {"collective_names": busiest.get("collective_names"), "op_names": busiest.get("op_names")}
                | {
                    "median_ms": statistics.median(wall[label]) * 1e3,
                    "step_ms": [t * 1e3 for t in wall[label]],
                }
                | {"cpu_ms": [t * 1e3 for t in cpu[label]], "wall_spread_ms": _ms(spread(wall[label]))}
                | {"cpu_spread_ms": _ms(spread(cpu[label]))}
                | {"ratio_to_adamw": spread(paired_ratios(wall[label], wall[reference]))}
                | {"cpu_ratio_to_adamw": spread(paired_ratios(cpu[label], cpu[reference]))}
                | {"first_step_s": max(c["first_s"] for c in at)}
            )
    return rows


def _ms(s: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e3 if k != "n" else v for k, v in s.items()}


def per_layer(rows: list[dict[str, Any]], layers: int, reference: str) -> None:
    """Add ops added per layer, and its ratio to the reference's at the same ranks, to every depth row."""
    ops = {(r["contender"], r["ranks"], r["layers"]): r["ops"] for r in rows}
    for r in rows:
        deep, shallow = ((r["contender"], r["ranks"], n) for n in (2 * layers, layers))
        r["ops_per_layer"] = (ops[deep] - ops[shallow]) / layers
    for r in rows:
        adamw = next(a for a in rows if a["contender"] == reference and a["ranks"] == r["ranks"])
        r["ratio_per_layer_to_adamw"] = r["ops_per_layer"] / adamw["ops_per_layer"]


def format_depth(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer / path | ranks | layers | top-level ops/step | ops added per layer "
        "| ratio to AdamW's | collectives/step | host ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['contender']} | {r['ranks']} | {r['layers']} | {r['ops']:,} | {r['ops_per_layer']:.1f} "
            f"| {r['ratio_per_layer_to_adamw']:.1f} | {r['collectives']} | {r['median_ms']:.1f} |"
        )
    return "\n".join(lines)


def format_timed(rows: list[dict[str, Any]], title: str) -> str:
    """A case's rows: counts, then medians with [25th-75th percentile] of wall and CPU ms per
    step and of each round's ratio to AdamW's step in the same round."""
    lines = [
        title,
        "| optimizer / path | top-level ops/step | collectives/step | wall ms/step | ratio to AdamW (wall) "
        "| main-thread CPU ms/step | ratio to AdamW (CPU) | first step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ops = "not counted" if r["ops"] is None else f"{r['ops']:,}"
        lines.append(
            f"| {r['contender']} | {ops} | {r['collectives'] if r['ops'] is not None else ''} "
            f"| {spread_text(r['wall_spread_ms'])} | {spread_text(r['ratio_to_adamw'], digits=2)} "
            f"| {spread_text(r['cpu_spread_ms'])} | {spread_text(r['cpu_ratio_to_adamw'], digits=2)} "
            f"| {r['first_step_s']:.1f} |"
        )
    return "\n".join(lines)
