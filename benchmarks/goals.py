"""A benchmark's goals, reported as measured figures against the goal, with no verdict.

Timings on a shared machine move with its load: a ratio of 0.56 against a goal of 0.55 reports the
machine as much as the code, and a PASS/FAIL line reads like a broken package. Each goal is printed
with what this run measured; whether it was reached is said in words and kept in the JSON.
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_goals", "goal"]


def goal(text: str, measured: str, met: bool) -> dict[str, Any]:
    """One goal: what it asks, this run's figure (as printed), and whether the figure reaches it."""
    return {"goal": text, "measured": measured, "met": met}


def format_goals(goals: list[dict[str, Any]]) -> str:
    """One line per goal: ``- <goal>: <measured>``, and ``(not reached in this run)`` where not."""
    lines = ["Goals (timings move with the machine's load; docs/benchmarks.md says by how much):"]
    for g in goals:
        lines.append(f"- {g['goal']}: {g['measured']}" + ("" if g["met"] else " (not reached in this run)"))
    return "\n".join(lines)
