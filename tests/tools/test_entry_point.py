"""``python -m muon_dtensor``: ``--version``, and an unknown or missing command says why it exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import muon_dtensor
from muon_dtensor.__main__ import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out == f"muon_dtensor {muon_dtensor.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["trian"], "error: unknown command 'trian': choose demo or plan"), ([], "no command given")],
)
def test_unknown_command_says_why(capsys: pytest.CaptureFixture[str], argv: list[str], reason: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err and "usage: python -m muon_dtensor {demo,plan}" in err


@pytest.mark.slow
def test_as_a_module() -> None:
    """The real command line: ``-m`` runs ``main`` and exits with its status."""
    done = subprocess.run([sys.executable, "-m", "muon_dtensor", "--version"], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, f"muon_dtensor {muon_dtensor.__version__}\n"), done.stderr


def test_usage_points_to_the_plan_modes_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert (
        "plan --check CONFIG --gpus N" in out
        and "plan --rehearse CONFIG --gpus N (--rank R | --busiest)" in out
    )
    assert "plan --help lists every mode's options" in out


def test_subcommands_are_dispatched_by_name_only(capsys: pytest.CaptureFixture[str]) -> None:
    """``__main__`` picks the module by the subcommand and hands it the rest: the mode flags are
    ``plan``'s own parser's (an argv scan sent "--rank" with "--check" to the check's parser)."""
    source = (Path(muon_dtensor.__file__).parent / "__main__.py").read_text()
    assert "--check" not in source.split("USAGE")[-1] and "--rehearse" not in source.split('"""')[-1]
    assert main(["plan", "--check", "llama3-8b", "--gpus", "8", "--rank", "3"]) == 2
    assert "--rank: not an option of --check" in capsys.readouterr().err
