"""The main job, ``python -m muon_dtensor demo``, end to end with a small setting, as a user runs it.

It trains on 2 ranks, saves a checkpoint at step 6, kills every rank after step 8, resumes on 1 rank
and must land on the uninterrupted run's parameters; then the same crash under the round-robin
double must lose half its momentum buffers and diverge.
"""

from __future__ import annotations

import re

import pytest
import torch

from muon_dtensor.demo.report import Outcome, verdict
from muon_dtensor.demo.run import main
from tests.conftest import DemoRun


@pytest.mark.slow
def test_demo_crashes_resumes_on_another_world_size_and_passes(demo_default: DemoRun) -> None:
    out, done = demo_default.stdout, demo_default
    assert done.returncode == 0, done.failure()
    verdict = next(line for line in out.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: PASS: resumed on 1 rank from a 2-rank checkpoint, the run tracks")
    assert "within float tolerance (largest parameter difference 0, bitwise equal)" in verdict
    assert "12 of 12 momentum buffers restored" in verdict
    assert re.search(r"^\| 0 \| __0_0\.distcp, \.metadata, manifest\.json \| [\d,]+ \|$", out, re.M)
    assert re.search(r"^\| 1 \| __1_0\.distcp \| [\d,]+ \|$", out, re.M)
    assert "| momentum buffers restored | 12 of 12 | 6 of 12 |" in out
    assert "killed after 8" in done.stderr and "12/12 steps" in done.stderr  # the progress bars

    results = done.results()
    ours, theirs = results["muon_dtensor"], results["round_robin"]
    assert set(ours["largest_parameter_difference"].values()) == {0.0}
    assert theirs["largest_parameter_difference"]["12"] > 1e-3  # round-robin lost momentum and diverged
    assert ours["losses_resumed"]["12"] == ours["losses_uninterrupted"]["12"]


def test_demo_rejects_too_few_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "2"]) == 2
    assert "--steps should be at least 4 but is 2" in capsys.readouterr().err


def _outcome(shift: float, final_loss: float, kept: int) -> Outcome:
    p = {"w": torch.zeros(2, 2)}
    straight = {"losses": {1: 4.0, 2: 3.0, 3: 2.0}, "params": {2: p, 3: p}}
    resumed = {"losses": {3: final_loss}, "params": {2: p, 3: {"w": p["w"] + shift}}, "kept": (kept, 12)}
    return Outcome(straight, resumed, save_at=2, crash_at=3)


def test_verdict_fails_on_drift_lost_momentum_or_no_learning() -> None:
    assert verdict(_outcome(0.0, 2.0, 12), 2, 1)[0]
    ok, line = verdict(_outcome(5e-3, 2.0, 12), 2, 4)
    assert ok and "within float tolerance (largest parameter difference 5.0e-03, tolerance 1e-02)" in line
    ok, line = verdict(_outcome(0.05, 2.0, 12), 2, 4)
    assert not ok and line.startswith("verdict: FAIL") and "does NOT track" in line
    assert verdict(_outcome(0.05, 2.0, 12), 2, 4, tolerance=0.1)[0]
    assert not verdict(_outcome(0.0, 2.0, 6), 2, 1)[0]  # momentum lost
    assert not verdict(_outcome(0.0, 3.9, 12), 2, 1)[0]  # loss did not fall by 10%
