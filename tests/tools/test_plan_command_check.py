"""``python -m muon_dtensor plan --check`` as a user types it (a subprocess each): its help, inputs it
refuses before any work (exit 2, a message naming the input and the limit, no traceback), and a
report that reads like a check (readable units, the config's head_dim, a suggestion when the owners
are unbalanced)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muon_dtensor.__main__ import main as package_main
from tests.harness import background
from tests.tools.test_launch_check import SMALL  # the same small config

ROOT = Path(__file__).resolve().parents[2]
REFUSE_S = 60  # a refusal is an import and a few checks: seconds, far from the minutes it replaces


def _plan(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m muon_dtensor plan *argv`` in a fresh interpreter, as a background job runs it."""
    command = [sys.executable, "-m", "muon_dtensor", "plan", *argv]
    return background.run(command, cwd=ROOT, env=background.importable(), timeout=300)


def _plan_job(name: str, *argv: str) -> object:
    """``_plan(*argv)`` as a background job (tests/harness/background.py) and its fixture ``name``."""
    background.job(name)(lambda folder: _plan(*argv))
    return background.reader(name)


plan_check_help = _plan_job("plan_check_help", "--check", "--help")
plan_help = _plan_job("plan_help", "--help")


@pytest.mark.slow  # a subprocess
def test_check_help_lists_its_options(plan_check_help: subprocess.CompletedProcess) -> None:
    done = plan_check_help
    assert done.returncode == 0, done.stderr
    for option in (
        "--check",
        "--gpus",
        "--hsdp",
        "--tp",
        "--head-dim",
        "--owners",
        "--ns-split",
        "--max-round-bytes",
    ):
        assert option in done.stdout, option
    assert "expected one argument" not in done.stderr


@pytest.mark.slow  # a subprocess
def test_plan_help_lists_every_mode_and_its_options(plan_help: subprocess.CompletedProcess) -> None:
    """One parser: ``plan --help`` lists --check and --rehearse with their options, under the mode
    that takes them (the help said "of --check" for options --rehearse took too)."""
    done = plan_help
    assert done.returncode == 0, done.stderr
    assert "before launch: --check or --rehearse, on a config.json or a preset" in done.stdout
    assert "--rehearse only:" in done.stdout and "of --check" not in done.stdout
    for option in (
        "--check [CONFIG]",
        "--rehearse [CONFIG]",
        "--hsdp R",
        "--tp T",
        "--head-dim D",
        "--rank RANK",
    ):
        assert option in done.stdout, option
    for option in ("--skip-ns", "--busiest", "--steps", "--ep", "--check-backend"):
        assert option in done.stdout, option


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


CASES = {
    "nested": ('{"a": ' * 100_000 + "1" + "}" * 100_000, [], "nests JSON deeper than the reader allows"),
    "a list": ("[1, 2]", [], "is not a model config: it holds a JSON list, not an object"),
    "width 10^12": (
        json.dumps(SMALL | {"hidden_size": 10**12}), [],
        "config field 'hidden_size' is 1,000,000,000,000, above the limit of 1,048,576",
    ),
    "10^9 layers": (
        json.dumps(SMALL | {"num_hidden_layers": 10**9}), [],
        "config field 'num_hidden_layers' is 1,000,000,000, above the limit of 10,000",
    ),
    "10^6 experts": (
        json.dumps(SMALL | {"num_local_experts": 10**6}), [],
        "config field 'num_local_experts' is 1,000,000, above the limit of 65,536",
    ),
    "10^7 GPUs": (json.dumps(SMALL), ["--gpus", "10000000"], "argument --gpus: 10,000,000 is above the limit of 131,072"),
    "negative round bytes": (
        json.dumps(SMALL), ["--max-round-bytes", "-1"],
        "argument --max-round-bytes: -1 is below 0: give a byte count, or 0 for one round",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_refused_before_any_work(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process, through the command's own entry point (the subprocess tests above and below
    run the user's form verbatim; a subprocess per refusal cost about 2.5 s each)."""
    text, extra, message = CASES[case]
    start = time.monotonic()
    code = package_main(["plan", "--check", _config(tmp_path, text), *(extra or ["--gpus", "8"])])
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert message in err and "Traceback" not in err, err
    assert time.monotonic() - start < REFUSE_S


@background.job("plan_reports")
def _plan_reports(folder: Path) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The small model's report on 8 GPUs and one layer of large matrices' on 16, both through the
    command in a fresh interpreter, in the background of the session."""
    (folder / "small").mkdir()
    (folder / "big").mkdir()
    one = {"hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 1, "num_attention_heads": 32}
    runs = []
    for name, config, gpus in (
        ("small", SMALL | {"head_dim": 16}, "8"),
        ("big", one | {"vocab_size": 1000}, "16"),
    ):
        runs.append(_plan("--check", _config(folder / name, json.dumps(config)), "--gpus", gpus))
    return runs[0], runs[1]


plan_reports = background.reader("plan_reports")


@pytest.mark.slow  # two subprocesses
def test_report_reads_like_a_check(
    plan_reports: tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]],
) -> None:
    """Bytes in units that fit a small model, the config's head_dim, and ns_split="auto" suggested for a
    layer of large matrices on 16 GPUs, where the owners are unbalanced and splitting pays."""
    small, big = plan_reports
    assert small.returncode == 0, small.stderr
    assert "| momentum (fp32) | 36.0 KiB | 36.0 KiB |" in small.stdout, small.stdout  # was 0.0 MiB
    assert "0.0" not in small.stdout.split("| per rank |")[1].split("modelled step")[0]
    assert (
        "Muon's q, k, v: per head of 16 rows (the config's head_dim; --head-dim 0: whole matrices)"
        in small.stdout
    )
    assert big.returncode == 0, big.stderr
    assert "suggestion: owners are unbalanced (the busiest rank's Newton-Schulz is" in big.stdout
    assert 'Muon(ns_split="auto") runs the largest matrices over a few ranks' in big.stdout
