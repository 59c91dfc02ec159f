"""CPU seconds per test: a pytest plugin, off unless asked for (``-p tests.harness.cpu_per_test``).

Each test's figure is the CPU that the pytest process and its descendants ran between its setup and
its teardown: the rank pools, launchers, and every process they started and reaped (``cutime``,
``cstime``). Background jobs (tests/harness/background.py) run beside the tests: run a tier without
their readers (``-m "not slow"`` has none) for clean figures, or read the session's total against the
sum of the tests'. Wall time on a shared host says how long a test waited; CPU seconds say what it
cost the cores.

    python -m pytest -q -p tests.harness.cpu_per_test --cpu-out cpu.json
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TICK = os.sysconf("SC_CLK_TCK")
_ROWS: list[dict[str, Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-out", default=None, help="write each test's CPU and wall seconds as JSON here")


def _processes() -> Iterator[tuple[int, int, float]]:
    """(pid, parent, own and reaped children's CPU seconds) of every process."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = sum(int(f) for f in fields[11:15]) / TICK
        yield int(entry.name), int(fields[1]), cpu


def _session_cpu() -> float:
    """CPU of this process, its live descendants and what they reaped."""
    table = {pid: (parent, cpu) for pid, parent, cpu in _processes()}
    mine, total = {os.getpid()}, 0.0
    changed = True
    while changed:
        changed = False
        for pid, (parent, _) in table.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine:
        total += table.get(pid, (0, 0.0))[1]
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    if not item.config.getoption("--cpu-out"):
        yield
        return
    cpu, wall = _session_cpu(), time.monotonic()
    yield
    _ROWS.append({"test": item.nodeid, "cpu_s": _session_cpu() - cpu, "wall_s": time.monotonic() - wall})


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = session.config.getoption("--cpu-out")
    if out:
        Path(out).write_text(json.dumps({"total_cpu_s": _session_cpu(), "tests": _ROWS}, indent=1))
