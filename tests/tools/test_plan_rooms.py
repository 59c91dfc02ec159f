"""The ``plan`` command in one room (issue 50 item 1): its parsing and printing live in ``tools/``,
``planning/`` keeps the arithmetic (no argparse, no print), and the old module paths stay in the
table of old paths (tests/base/test_moved.py imports each and checks its warning), ``planning.cli.Layout``
the pure one."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import muon_dtensor
from muon_dtensor.base.moved import KEPT

PLANNING = Path(muon_dtensor.__file__).parent / "planning"


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


def test_the_old_plan_path_gives_the_pure_layout() -> None:
    """``planning.cli`` and ``tools.topology`` are old paths of the table: each is the new module and
    warns once, as a fresh process sees it (tests/base/test_moved.py, every old path). What only
    this room's move adds: ``Layout`` through the old path is the pure one of ``planning.inputs``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from muon_dtensor.planning.cli import Layout  # type: ignore[import-not-found]
    from muon_dtensor.planning.inputs import Layout as Pure

    assert Layout is Pure
    assert {"muon_dtensor.planning.cli", "muon_dtensor.tools.topology"} <= {k.old for k in KEPT}
