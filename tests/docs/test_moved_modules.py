"""The module paths that moved in 0.2.0 (CHANGELOG.md) import again, for one release: the old path
gives the new module itself, with a DeprecationWarning that names the new path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from muon_dtensor import MOVED

ROOT = Path(__file__).resolve().parents[2]
# Each old path imported first in a fresh interpreter (an import is cached after its first time).
PROBE = """
import importlib, json, sys, warnings
out = {}
for old, new in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("muon_dtensor." + old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    out[old] = [module is importlib.import_module("muon_dtensor." + new), module.__spec__.name, messages]
print(json.dumps(out))
"""


def test_every_moved_path_imports_the_new_module_with_a_warning() -> None:
    # the old packages' submodules after their parents, so each warning is its own
    ordered = dict(sorted(MOVED.items(), key=lambda kv: kv[0].count(".")))
    run = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(ordered)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    for old, (same, spec, messages) in json.loads(run.stdout).items():
        new = f"muon_dtensor.{MOVED[old]}"
        assert same and spec == new, (old, spec)
        assert any(m.startswith(f"muon_dtensor.{old} moved to {new} in 0.2.0") for m in messages), (
            old,
            messages,
        )


def test_the_changelog_lists_the_moves() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for old in ("muon_dtensor.resume_check", "muon_dtensor.hf", "muon_dtensor._compat"):
        assert f"`{old}`" in changelog
