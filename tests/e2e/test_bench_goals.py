"""``benchmarks/bench_step.py`` reports each goal with the measured figure, not a PASS/FAIL verdict:
a busy machine's 0.56 against the 0.55 goal prints as that, and reads as a timing, not a breakage."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench_step import DISTRIBUTED, SINGLE, check_targets  # noqa: E402
from benchmarks.goals import format_goals  # noqa: E402


def _rows(owner_ms: float) -> list[dict[str, Any]]:
    """One-process torch at 1000 ms, and the 2-rank contenders; ratios are to the 1000 ms."""
    times = [(SINGLE[0][0], 1, 1000.0), (SINGLE[1][0], 1, 990.0)]
    times += [
        (DISTRIBUTED[0][0], 2, 1460.0),
        (DISTRIBUTED[1][0], 2, 1000.0),
        (DISTRIBUTED[2][0], 2, owner_ms),
    ]
    return [{"contender": c, "ranks": n, "median_ms": ms, "ratio": ms / 1000.0} for c, n, ms in times]


TRAFFIC = [{"mode": "owner", "ranks": 2, "mean_off_percent": 0.0}]


def test_a_ratio_over_its_goal_is_reported_not_judged() -> None:
    goals = check_targets(_rows(560.0), TRAFFIC)
    text = format_goals(goals)
    assert (
        "owner step / torch.optim.Muon one-process step at N=2 <= 0.55: 0.56 (not reached in this run)"
        in text
    )
    assert "owner faster than every alternative at N=2: 560.0 ms against 990.0 ms" in text
    assert "owner mean bytes within 5% of the formula at N=2: +0.0%" in text
    assert "FAIL" not in text and "PASS" not in text
    assert [g["met"] for g in goals] == [False, True, True, True]


def test_goals_reached_print_no_remark() -> None:
    text = format_goals(check_targets(_rows(530.0), TRAFFIC))
    assert "<= 0.55: 0.53\n" in text and "not reached" not in text
