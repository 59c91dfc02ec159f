"""The layers, held to the code: each folder of the package is one layer, and a module imports only
from its own layer or lower ones (function-level imports included), with no import cycle:

    base <- numerics <- sharding/plan <- sharding/runtime <- checks <- features <- optim
         <- checkpoint <- integrations <- testing <- tools <- demo

``base/`` is the floor: the torch shims every private torch name goes through
(tests/base/test_private_torch.py), what a parameter's name says, and warnings at the user's line.

``planning/`` stands beside them: it prices the math and the plan and never talks, and the optimizer
reaches it only through ``optim/policy.py``, where the ``"auto"`` options are priced. A new module's
layer is its folder, so there is no table of modules to keep; docs/design.md's layer table names the
same folders (checked below), so the prose cannot drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "muon_dtensor"
# Lowest first. The package's own __init__ and __main__ sit above every layer.
LAYERS = [
    "base", "numerics", "sharding.plan", "sharding.runtime", "checks", "features", "optim",
    "checkpoint", "integrations", "testing", "tools", "demo",
]  # fmt: skip
PLANNING = "planning"
TOP = len(LAYERS)
FIRST_ABOVE_STEP = LAYERS.index("checkpoint")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _layer(module: str) -> int | str:
    """A module's layer: the longest layer folder its path starts with."""
    if module.split(".")[0] == PLANNING:
        return PLANNING
    if module in ("", "__init__", "__main__"):
        return TOP
    if module == "sharding":  # the folder's own __init__: below its plan
        return LAYERS.index("sharding.plan")
    found = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    assert found, f"muon_dtensor.{module} is in no layer folder: move it into one of {LAYERS}"
    return LAYERS.index(max(found, key=len))


def _imports(path: Path) -> set[str]:
    """The package modules ``path`` imports, anywhere in the file, as dotted names below the package."""
    here = _module(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "muon_dtensor":
                base = []
            else:
                continue
            target = [*base, *(node.module or "").split(".")] if node.module else base
            target = [t for t in target if t and t != "muon_dtensor"]
            for alias in node.names:  # `from . import x` may name a module
                sub = PACKAGE.joinpath(*target, alias.name)
                out.add(
                    ".".join([*target, alias.name])
                    if sub.with_suffix(".py").exists() or sub.is_dir()
                    else ".".join(target)
                )
        elif isinstance(node, ast.Import):
            out.update(
                a.name.removeprefix("muon_dtensor.") for a in node.names if a.name.startswith("muon_dtensor.")
            )
    return {m for m in out if m}


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    known = {_module(f) for f in files}
    return {_module(f): {m for m in _imports(f) if m in known and m != _module(f)} for f in files}


def _allowed(source: str, target: str) -> bool:
    s, t = _layer(source), _layer(target)
    if t == PLANNING:  # beside the step: planning itself, the step's policy and what sits above the step
        return s == PLANNING or source == "optim.policy" or (isinstance(s, int) and s >= FIRST_ABOVE_STEP)
    if s == PLANNING:  # below nothing: planning prices the math and the plan, never talks
        return t in (LAYERS.index("numerics"), LAYERS.index("sharding.plan"))
    assert isinstance(s, int) and isinstance(t, int)
    return t <= s


def _name(layer: int | str) -> str:
    return layer if isinstance(layer, str) else (LAYERS[layer] if layer < TOP else "top")


def test_no_module_imports_a_higher_layer() -> None:
    broken = [
        f"{s} ({_name(_layer(s))}) imports {t} ({_name(_layer(t))})"
        for s, targets in _graph().items()
        for t in sorted(targets)
        if not _allowed(s, t)
    ]
    assert not broken, "layer arrows broken:\n" + "\n".join(broken)


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # A package's __init__ importing its own submodules is not a cycle of the code's layers.
    real = [c for c in cycles if not re.fullmatch(r"(\w+) -> \1\.\w+ -> \1", c)]
    assert not real, "import cycles:\n" + "\n".join(real)


def test_every_module_is_in_a_layer_folder() -> None:
    """Only the package's entry points sit at the top level: every other module is in a layer."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside the layer folders: {loose}"
    folders = {".".join(p.relative_to(PACKAGE).parts[:-1]) for p in PACKAGE.rglob("__init__.py")}
    assert folders - {""} <= {*LAYERS, PLANNING, "sharding"}, sorted(
        folders - {*LAYERS, PLANNING, "sharding", ""}
    )


@pytest.mark.parametrize("layer", [*LAYERS, PLANNING])
def test_design_md_names_each_layer_folder_and_its_modules(layer: str) -> None:
    """docs/design.md's layer table has a row per folder, in this order, naming every module in it."""
    table = (PACKAGE.parent / "docs" / "design.md").read_text().split("## A step")[0]
    rows = [line for line in table.splitlines() if line.startswith("| **")]
    folder = layer.replace(".", "/") + "/"
    mine = [r for r in rows if r.startswith(f"| **{folder}**")]
    assert mine, f"docs/design.md's layer table has no row for **{folder}**"
    order = [r.split("**")[1] for r in rows]
    assert order == [f.replace(".", "/") + "/" for f in [*LAYERS, PLANNING]], order
    modules = sorted(
        p.name for p in PACKAGE.joinpath(*layer.split(".")).glob("*.py") if p.name != "__init__.py"
    )
    missing = [m for m in modules if f"`{m}`" not in mine[0]]
    assert not missing, f"docs/design.md's row for {folder} does not name {missing}"


@pytest.mark.parametrize("layer", [*LAYERS, PLANNING])
def test_each_folder_docstring_points_to_its_row_and_names_all_or_none(layer: str) -> None:
    """A layer folder's ``__init__`` docstring points to its row of docs/design.md's table, and if it
    names its modules (as ``name``), it names every one of them, so a reader of the folder misses none."""
    folder = PACKAGE.joinpath(*layer.split("."))
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    path = layer.replace(".", "/") + "/"
    assert f"``{path}``" in doc and "docs/design.md" in doc, (
        f"muon_dtensor/{path}__init__.py's docstring should point to row ``{path}`` of docs/design.md's table"
    )
    modules = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
    named = [m for m in modules if f"``{m}``" in doc]
    missing = sorted(set(modules) - set(named))
    assert not named or not missing, f"muon_dtensor/{path}__init__.py names {named} but not {missing}"


def test_tests_mirror_the_package_with_no_test_file_at_the_root() -> None:
    """A test sits in the folder of what it tests (CONTRIBUTING.md, "Where a change goes"): the
    harness's own tests in ``tests/harness/``, shared helpers in ``tests/helpers/``; at the root
    only ``conftest.py`` and the package's ``__init__.py``."""
    root = PACKAGE.parent / "tests"
    stray = sorted(p.name for p in root.glob("*.py") if p.name not in ("conftest.py", "__init__.py"))
    assert not stray, (
        f"files at the tests root: {stray}; move a test into the folder it tests, a helper into tests/helpers/"
    )
