"""The demo's arguments and report: a layout it cannot build is refused, results.json keeps typed
arguments, and each resumed run is reported against its own uninterrupted twin (no ranks run here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from muon_dtensor.demo import report, run
from muon_dtensor.demo.parallel import demo_shape, layout_problem
from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120  # seconds for one `python -m muon_dtensor demo` that exits before starting ranks


@pytest.mark.parametrize(
    ("layout", "world", "words"),
    [
        (
            "hsdp",
            3,
            ["--layout hsdp needs an even --world-size of at least 4", "--world-size is 3", "replicate=1"],
        ),
        ("hsdp", 2, ["--world-size is 2", "Use --world-size 4", "--layout fsdp for 2 rank(s)"]),
        ("fsdp-tp", 3, ["--layout fsdp-tp needs an even --world-size", "tp=1", "Use --world-size 4"]),
    ],
)
def test_a_layout_that_would_silently_be_fsdp_is_refused(
    layout: str, world: int, words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run.main(["--layout", layout, "--world-size", str(world)]) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    ("layout", "world"), [("fsdp", 3), ("hsdp", 4), ("hsdp", 6), ("fsdp-tp", 2), ("fsdp-tp", 4)]
)
def test_layouts_the_demo_builds_are_what_they_say(layout: str, world: int) -> None:
    assert layout_problem(layout, world) is None
    shape = demo_shape(layout, world)
    assert shape.replicas == (2 if layout == "hsdp" else 1) and shape.tp == (2 if layout == "fsdp-tp" else 1)


hsdp_on_3_ranks = background.command(
    "hsdp_on_3_ranks", [sys.executable, "-m", "muon_dtensor", "demo", "--layout", "hsdp", "--world-size", "3"],
    cwd=ROOT, timeout=TIMEOUT,
    env=background.importable(),
)  # fmt: skip


@pytest.mark.slow
def test_the_command_exits_2_with_the_message(hsdp_on_3_ranks: subprocess.CompletedProcess) -> None:
    done = hsdp_on_3_ranks
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: --layout hsdp needs an even --world-size of at least 4"), (
        done.stderr
    )
    assert done.stdout == ""


def _outcome(shift: float, final_loss: float, kept: int) -> report.Outcome:
    p = {"w": torch.zeros(2, 2)}
    moved = {"w": p["w"] + shift}
    straight = {"losses": {1: 4.0, 2: 3.0, 3: 2.5, 4: 2.0}, "params": {2: p, 3: p, 4: p}}
    resumed = {"losses": {3: 2.5, 4: final_loss}, "params": {2: p, 3: moved, 4: moved}, "kept": (kept, 12)}
    return report.Outcome(straight, resumed, save_at=2, crash_at=3)


def test_results_json_keeps_typed_arguments(tmp_path: Path) -> None:
    args = run._parser().parse_args(["--out", str(tmp_path), "--steps", "12", "--tolerance", "0.005"])
    (tmp_path / "checkpoints").mkdir()
    run._write(args, _outcome(0.0, 2.0, 12), _outcome(0.1, 1.9, 6), 12.34)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["args"] == {
        "world_size": 2,
        "resume_world_size": 1,
        "steps": 12,
        "layout": "fsdp",
        "tolerance": 0.005,
        "out": str(tmp_path),
        "normuon": False,
    }
    assert saved["seconds"] == 12.3
    assert saved["environment"]["torch"] == torch.__version__
    assert isinstance(saved["environment"]["avx512_bf16"], bool)
    assert saved["muon_dtensor"]["left_twin_at"] is None and saved["round_robin"]["left_twin_at"] == 3


def test_each_run_is_reported_against_its_own_twin() -> None:
    ours, theirs = _outcome(0.0, 2.0, 12), _outcome(0.1, 1.9, 6)
    table = report.twin_table(ours, theirs, 1000, 500)
    assert "| momentum buffers restored | 12 of 12 | 6 of 12 |" in table
    assert (
        "| resumed run leaves its twin | never: bitwise equal through step 4 "
        "| at step 3 (the first step after the resume), by 1.0e-01 |" in table
    )
    assert "| largest parameter difference from its twin at step 4 | 0 | 1.0e-01 |" in table
    assert "| loss at step 4: twin, resumed | 2.0000, 2.0000 | 2.0000, 1.9000 |" in table
    lines = report.lessons(ours, theirs, 2, 1)
    assert [line.split(":")[0] for line in lines] == [
        "- reproducible",
        "- debuggable",
        "- why round-robin's lower loss says nothing",
    ]
    assert all("\n" not in line for line in lines)
    assert "its twin bit for bit (here on 1 rank, the twin on 2)" in lines[0]
    assert "Round-robin's resumed run is another run from step 3 on" in lines[0]
    drifted = report.lessons(_outcome(1e-3, 2.0, 12), theirs, 2, 4)  # another world size: float rounding
    assert "within float rounding of its twin (parameter difference 1.0e-03 at step 4" in drifted[0]
    assert "bit for bit (here" not in " ".join(drifted)
