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

__all__ = ["paired_ratios", "rotated", "spread", "spread_text"]


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
