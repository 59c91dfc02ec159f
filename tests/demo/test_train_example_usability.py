"""``examples/train.py``: ``--help`` shows every default, and resuming a finished run says so (at
``--steps``) or refuses (past it) instead of silently doing nothing."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.demo.test_train_schedule import LINE, _example, _run


def test_help_shows_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        _example().parse(["--help"])
    assert e.value.code == 0
    # one entry per option: its first line starts "  --", wrapped lines are indented further
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=--)", out.getvalue())[1:]]
    options = {e.split()[0]: e for e in entries}
    for flag, default in [("--dim", "64"), ("--steps", "200"), ("--lr", "0.02"), ("--adamw-lr", "0.003"),
                          ("--save-every", "50"), ("--ckpt", "runs/train"), ("--dp", "world size / tp")]:  # fmt: skip
        assert options[flag].endswith(f"(default: {default})"), (flag, options[flag])
    assert all(text.count("(default:") <= 1 for text in options.values()), options
    assert "(default: None)" not in out.getvalue() and "(default: False)" not in out.getvalue()


def test_resuming_a_finished_run_says_so(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    _run("--steps", "3", "--ckpt", ckpt)
    again = _run("--steps", "3", "--ckpt", ckpt, "--resume")
    assert "resumed from" in again and not LINE.search(again), again
    assert "the run is finished: the checkpoint is at step 3 = --steps; nothing to train" in again, again
    past = _run("--steps", "2", "--ckpt", ckpt, "--resume", "--stretch-schedule")
    assert "SystemExit: error: the checkpoint is at step 3, past --steps 2: nothing to train" in past, past
