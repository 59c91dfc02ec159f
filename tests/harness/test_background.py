"""The background jobs' subprocesses (tests/harness/background.py) start where and with what the
session started, whatever a test beside them has changed for a while."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.harness import background


def test_a_job_started_while_a_test_has_moved_runs_in_the_sessions_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = os.getcwd()
    monkeypatch.chdir(tmp_path)  # as test_launcher's served-launch test does, for a while
    monkeypatch.setenv("MUON_DTENSOR_BACKGROUND_TEST", "1")
    probe = "import os; print(os.getcwd(), os.environ.get('MUON_DTENSOR_BACKGROUND_TEST'))"
    done = background.run([sys.executable, "-c", probe], env=background.environ(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [start, "None"]
    elsewhere = background.run([sys.executable, "-c", probe], cwd=tmp_path, timeout=60)
    assert elsewhere.stdout.split() == [str(tmp_path), "1"]  # a job's own cwd and env still win
