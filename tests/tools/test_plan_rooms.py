"""The ``plan`` command in one room (issue 50 item 1): its parsing and printing live in ``tools/``,
``planning/`` keeps the arithmetic (no argparse, no print), and the old module paths import the new
modules with a DeprecationWarning naming the new path, ``planning.cli.Layout`` included."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import muon_dtensor

PLANNING = Path(muon_dtensor.__file__).parent / "planning"
ROOT = Path(muon_dtensor.__file__).parents[1]


def test_planning_neither_parses_nor_prints() -> None:
    found = []
    for path in sorted(PLANNING.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                found += [f"{path.name}: imports argparse" for n in names if n.split(".")[0] == "argparse"]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{path.name}:{node.lineno}: print")
    assert not found, found


PROBE = """
import importlib, json, warnings
out = {}
for old, new in (("planning.cli", "tools.plan_command"), ("tools.topology", "tools.launch_check")):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("muon_dtensor." + old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    out[old] = [module is importlib.import_module("muon_dtensor." + new), messages]
from muon_dtensor.planning.cli import Layout
from muon_dtensor.planning.inputs import Layout as Pure
out["Layout"] = Layout is Pure
print(json.dumps(out))
"""


def test_old_paths_import_the_new_modules_with_a_warning() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out.pop("Layout") is True
    for old, (same, messages) in out.items():
        assert same, old
        assert any(f"muon_dtensor.{old} moved to" in m and "0.6.0" in m for m in messages), (old, messages)
