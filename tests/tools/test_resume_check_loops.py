"""The resume check runs the user's loop where it lives: ``build`` and ``train_step`` in a module next
to the user's script, or in the script itself, with the script run from another folder (a
subprocess each, as the user runs it: 1 rank, 3 steps). What cannot work (a lambda, a nested
function, a script that would start the check again in every rank, a loop with no file) and bad
arguments are refused before any rank starts, with the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from muon_dtensor.testing.rank import resolve
from muon_dtensor.testing.runner import MAX_LOCAL_RANKS, function_ref
from muon_dtensor.tools import resume_check
from muon_dtensor.tools.resume_check import run_resume_check
from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
LOOP = """
import torch
from torch import nn

from muon_dtensor import Muon


def build(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False))
    return model, Muon(model.parameters(), lr=0.02), None


def train_step(model, opt, sched, step, rank, world):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""
CHECK = """
import json

from muon_dtensor.tools.resume_check import run_resume_check

if __name__ == "__main__":
    out = run_resume_check(build, train_step, steps=3, save_at=2, world_sizes=(1, 1), timeout=240)
    print(json.dumps({k: out[k] for k in ("bitwise", "passed", "cause")}))
"""


def _run(script: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python script`` from ``cwd``, as a user runs it."""
    cwd.mkdir(exist_ok=True)
    env = background.importable()
    return background.run([sys.executable, str(script), *args], cwd=cwd, env=env, timeout=600)


def _bitwise(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"bitwise": True, "passed": True, "cause": None}


@background.job("loop_in_a_module")
def _loop_in_a_module(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    (tmp_path / "myloop.py").write_text(LOOP)
    script = tmp_path / "check_resume.py"
    script.write_text("from myloop import build, train_step\n" + CHECK)
    return _run(script, tmp_path / "elsewhere")


@background.job("loop_in_the_script")
def _loop_in_the_script(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(LOOP + CHECK)
    return _run(script, tmp_path / "elsewhere")


loop_in_a_module = background.reader("loop_in_a_module")


loop_in_the_script = background.reader("loop_in_the_script")


@pytest.mark.slow
def test_a_loop_in_a_module_next_to_the_script(loop_in_a_module: subprocess.CompletedProcess[str]) -> None:
    """Before: ``ModuleNotFoundError: No module named 'myloop'`` in every rank."""
    _bitwise(loop_in_a_module)


@pytest.mark.slow
def test_a_loop_in_the_script_itself(loop_in_the_script: subprocess.CompletedProcess[str]) -> None:
    """Before: ``AttributeError: Can't get attribute 'build' on <module ...>`` in every rank."""
    _bitwise(loop_in_the_script)


@background.job("loop_refused_in_every_rank")
def _loop_refused_in_every_rank(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(LOOP + CHECK.replace('if __name__ == "__main__":\n', "").replace("\n    ", "\n"))
    return _run(script, tmp_path / "elsewhere")


@background.job("loop_with_no_file")
def _loop_with_no_file(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    code = LOOP + "\nfrom muon_dtensor.tools.resume_check import run_resume_check\n"
    code += "run_resume_check(build, train_step, steps=3, save_at=2, world_sizes=(1, 1))\n"
    env = background.importable()
    return background.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=600)


loop_refused_in_every_rank = background.reader("loop_refused_in_every_rank")


loop_with_no_file = background.reader("loop_with_no_file")


@pytest.mark.slow
def test_a_script_that_would_start_the_check_in_every_rank_is_refused(
    loop_refused_in_every_rank: subprocess.CompletedProcess[str],
) -> None:
    done = loop_refused_in_every_rank
    assert (
        done.returncode == 1
        and "ValueError: build is defined in train.py, which each rank runs" in done.stderr
    )
    assert (
        "put the call under that guard, or move build and train_step into a module, e.g. myloop.py"
        in done.stderr
    )


@pytest.mark.slow
def test_a_loop_with_no_file_is_refused(loop_with_no_file: subprocess.CompletedProcess[str]) -> None:
    done = loop_with_no_file
    assert done.returncode == 1, done.stderr
    assert "build is defined in __main__ with no script file" in done.stderr
    assert "move build and train_step into a module, e.g. myloop.py" in done.stderr


def build_here(rank: int, world: int) -> Any:
    raise AssertionError("not run: every call below is refused before any rank starts")


def step_here(*args: Any) -> None:
    raise AssertionError("not run")


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank started")

    monkeypatch.setattr(resume_check, "run_ranks", started)


def test_what_ranks_cannot_import_is_refused_with_the_fix(no_ranks: None) -> None:
    def nested(*args: Any) -> None:
        pass

    with pytest.raises(TypeError, match=r"nested is defined inside a function .*e\.g\. myloop\.py next to"):
        run_resume_check(build_here, nested, steps=3, save_at=2)
    with pytest.raises(TypeError, match=r"build should be a module-level function .* is a lambda"):
        run_resume_check(cast(Any, lambda r, w: None), step_here, steps=3, save_at=2)
    with pytest.raises(ValueError, match=r"build='no_such_loop:build': cannot import 'no_such_loop'"):
        run_resume_check("no_such_loop:build", step_here, steps=3, save_at=2)
    with pytest.raises(ValueError, match=r"module 'tests.tools.test_resume_check_loops' has no 'nothing'"):
        run_resume_check(f"{__name__}:nothing", step_here, steps=3, save_at=2)


def test_module_function_strings_name_the_same_function() -> None:
    ref = function_ref(f"{__name__}:build_here", "build", "run_resume_check")
    assert ref == function_ref(build_here, "build", "run_resume_check")
    assert str(ref) == f"{__name__}:build_here" and str(ROOT) in ref.paths
    assert resolve(ref) is build_here


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout": -1}, "timeout should be a positive, finite number of seconds .* but is -1"),
        ({"timeout": float("nan")}, "timeout should be a positive, finite number of seconds .* but is nan"),
        (
            {"report": "/no/such/folder/report.json"},
            "the folder of '/no/such/folder/report.json' .* does not exist",
        ),
        (
            {"world_sizes": (10**6, 1)},
            f"save world size 1,000,000 is above the limit of {MAX_LOCAL_RANKS} local",
        ),
        ({"world_sizes": (2, 10**6)}, "resume world size 1,000,000 is above the limit"),
    ],
)
def test_bad_arguments_are_refused_before_any_rank_starts(
    no_ranks: None, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        run_resume_check(build_here, step_here, steps=3, save_at=2, **kwargs)


def test_a_report_path_that_is_a_folder_is_refused(no_ranks: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a folder: pass a file in it, e.g. .*resume_report.json"):
        run_resume_check(build_here, step_here, steps=3, save_at=2, report=tmp_path)


def test_docs_show_a_layout_the_check_runs() -> None:
    text = (ROOT / "docs" / "resume.md").read_text()
    section = text.split("### Where the loop lives", 1)[1]
    for shown in ("myloop.py", 'if __name__ == "__main__":', "def build(rank, world)", '"myloop:build"'):
        assert shown in section, shown
