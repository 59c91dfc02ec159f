"""Session set-up. Tiers (markers in pyproject.toml): plain ``pytest`` runs everything, as CI does;
``pytest -m "not slow"`` is the fast loop (no demo runs, no fresh-process launches, samples of the
exhaustive checks); ``-m integration`` selects what runs transformers/accelerate, Lightning or torchtitan.

The pools of rank processes (tests/harness/ranks.py) stop where the readers of the background jobs
begin and when the session ends; the runs that tests read
(the demo runs, ``demo_*`` fixtures, and the jobs other modules register: tests/harness/background.py) run
once per session, in the background from the end of collection, one after another, and only those
a selected test reads; the tests that read them run last, so the runs overlap the rest of the
session; a ``sample_of`` test gives way to its slow test."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness import background, ranks

# Bytecode is written for this session and every interpreter it starts (the pools' zygote, the
# launchers): where the image sets PYTHONDONTWRITEBYTECODE=1, pytest rewrote and compiled every test
# module at every collection, 3 to 4 s of each session here (tests/README.md, "The rules of a
# pytest run"). The caches are git-ignored __pycache__ folders.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 600  # seconds per demo run; generous: it shares the 2 cores with the rest of the session
# The demo runs tests read, by fixture name: the demo's arguments and extra environment.
DEMOS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # as the README runs it, 12 steps: 2 ranks, killed after step 8, resumed on 1 (test_demo)
    "demo_default": (("--steps", "12"), {}),
    # one shorter run for two claims that need the demo's output, not a long run: forced to
    # emulated bf16 it runs Newton-Schulz in float32 and says so (test_cpu_probe), and --qk-clip
    # prints the logits before and after clipping (test_qk_clip)
    "demo_emulated_qk_clip": (("--steps", "4", "--qk-clip", "1.2"), {"MUON_DTENSOR_CPU_BF16": "emulated"}),
}


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in the session's own process, as every rank has (tests/harness/ranks.py,
    ``muon_dtensor.testing``): the tests' matrices are small, and the process shares the cores with the rank
    pools, the background demo runs and subprocesses, where a second BLAS thread mostly waits for a
    core (test_gap_to_torch_optim_muon took 115 s on 2 busy cores with two threads, 2.7 s with one).
    The rank pools' zygote starts now, importing torch on the core the collection leaves idle."""
    torch.set_num_threads(1)
    if not config.option.collectonly:
        ranks.start_zygote()


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    yield
    ranks.shutdown()


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect samples whose slow test runs too; move the tests that read a background job (a demo
    run, an example's launches: tests/harness/background.py) to the end and start those jobs."""
    _deselect_samples(config, items)
    reads = {item: set(getattr(item, "fixturenames", ())) & background.JOBS.keys() for item in items}
    if any(reads.values()):
        items.sort(key=lambda item: bool(reads[item]))  # stable: the readers last, in their order
        _FIRST_READER[:] = [next(item.nodeid for item in items if reads[item])]
        names = list(dict.fromkeys(name for item in items for name in sorted(reads[item])))
        if not config.option.collectonly:
            background.start(names)


_FIRST_READER: list[str] = []  # the node id of the first test that reads a background job


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Stop the rank pools where the readers of the background jobs begin: the readers mostly wait
    for their jobs, while an idle pool's workers keep polling their gloo groups (tests/README.md);
    a reader that needs a pool starts one."""
    if _FIRST_READER and item.nodeid == _FIRST_READER[0]:
        ranks.shutdown()


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop()


def _deselect_samples(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``sample_of`` test is a seeded sample of a slow test's cases: where that test is selected
    too (plain ``pytest``), it checks every case of the sample, so the sample is deselected."""
    selected = {item.nodeid for item in items}
    samples = []
    for item in items:
        marker = item.get_closest_marker("sample_of")
        if marker is None:
            continue
        full = f"{item.nodeid.split('::')[0]}::{marker.args[0]}"
        if full not in _module_tests(item):
            raise pytest.UsageError(
                f"{item.nodeid}: sample_of({marker.args[0]!r}) names no test of its module"
            )
        if full in selected:
            samples.append(item)
    if samples:
        config.hook.pytest_deselected(items=samples)
        items[:] = [item for item in items if item not in samples]


def _module_tests(item: pytest.Item) -> set[str]:
    """The node ids of the test functions in ``item``'s module, selected or not."""
    module = item.getparent(pytest.Module)
    assert module is not None
    return {f"{module.nodeid}::{name}" for name in dir(module.obj) if name.startswith("test_")}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How often rank pools started (each start imports torch on every rank and meets over gloo),
    and when each background job ran (a session that ends waiting on one is bound by the jobs)."""
    if background.TIMES:
        spans = ", ".join(f"{n} {a:.0f}-{b:.0f}" for n, a, b in background.TIMES)
        terminalreporter.write_line(f"background jobs (s after collection): {spans}")
    if ranks.STARTS:
        seconds = sum(s for _, s, _, _ in ranks.STARTS)
        sizes = sorted({w for w, _, _, _ in ranks.STARTS})
        counts = ", ".join(f"{w} ranks: {sum(1 for x, _, _, _ in ranks.STARTS if x == w)}" for w in sizes)
        own = sum(1 for *_, forked in ranks.STARTS if not forked)
        terminalreporter.write_line(
            f"rank pools started: {len(ranks.STARTS)} ({counts}), {seconds:.1f} s; "
            f"{own} with an interpreter of their own, the rest forked by the zygote"
        )
        if os.environ.get("MUON_DTENSOR_POOL_STARTS"):
            for w, s, test, forked in ranks.STARTS:
                how = "forked" if forked else "own interpreter"
                terminalreporter.write_line(f"  {w} ranks, {s:.1f} s, {how}, for {test}")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One BLAS thread for the test: with several, MKL may split a lone product's work another way
    than a batch's (bits of float64 products then depend on the batch on Intel hosts), so batch
    independence is claimed, and checked, for one thread (docs/api.md, ``newton_schulz``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class DemoRun:
    """One ``python -m muon_dtensor demo`` as a user runs it: exit code, output, output folder."""

    returncode: int
    stdout: str
    stderr: str
    out: Path

    def results(self) -> dict[str, Any]:
        """The run's ``results.json``."""
        return json.loads((self.out / "results.json").read_text())

    def failure(self) -> str:
        """What to show when the run failed."""
        return self.stdout + self.stderr[-4000:]


def _run_demo(name: str, folder: Path) -> DemoRun:
    """``python -m muon_dtensor demo`` with ``DEMOS[name]``'s arguments and environment."""
    args, env = DEMOS[name]
    out, logs = folder / "out", folder / "demo"
    environ = background.importable(**env)
    out.mkdir()
    with open(logs.with_suffix(".out"), "w") as stdout, open(logs.with_suffix(".err"), "w") as stderr:
        proc = background.popen(
            [sys.executable, "-m", "muon_dtensor", "demo", *args, "--out", str(out)],
            cwd=ROOT, env=environ, stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=DEMO_TIMEOUT)
        except subprocess.TimeoutExpired:
            background.kill(proc)
            code = proc.wait()
    err = logs.with_suffix(".err").read_text()
    if code == -signal.SIGKILL:
        err += f"\n(killed: no result after {DEMO_TIMEOUT} s, or the session ended)"
    return DemoRun(code, logs.with_suffix(".out").read_text(), err, out)


for _name in DEMOS:
    background.job(_name)(functools.partial(_run_demo, _name))


@pytest.fixture(scope="session")
def demo_default() -> DemoRun:
    """``DEMOS["demo_default"]``, once per session (test_demo)."""
    return background.result("demo_default")


@pytest.fixture(scope="session")
def demo_emulated_qk_clip() -> DemoRun:
    """``DEMOS["demo_emulated_qk_clip"]``, once per session (test_cpu_probe, test_qk_clip)."""
    return background.result("demo_emulated_qk_clip")
