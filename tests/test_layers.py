"""The layers, held to the code: Math <- Plan <- Comm <- Step <- Checkpoint / Demo, with Planning
beside the step and below nothing. A module imports only from its own layer or lower ones
(function-level imports included); nothing below the step imports Planning, and the step reaches it
only through ``policy.py``, where the ``"auto"`` options are priced. No import cycles.

docs/design.md's module table names the same layers (checked below), so the prose cannot drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "muon_dtensor"
MATH, PLAN, COMM, STEP, TOP = range(5)
PLANNING = "planning"
LAYERS: dict[str, int | str] = {
    "newton_schulz": MATH, "elementwise": MATH, "normuon": MATH, "split_ns": MATH, "_compat": MATH,
    "_docs": MATH,
    "_sharding.blocks": PLAN, "_sharding.param_layout": PLAN, "_sharding.views": PLAN,
    "_sharding.plan": PLAN, "_sharding.routes": PLAN, "_sharding.runs": PLAN, "_sharding.gangs": PLAN,
    "_sharding.domains": PLAN, "_sharding.owners": PLAN, "_sharding.memory": PLAN,
    "_sharding.comm": COMM, "_sharding.groups": COMM, "_sharding.exchange": COMM,
    "_sharding.split_exchange": COMM,
    "functional": STEP, "optimizer": STEP, "validation": STEP, "preflight": STEP, "agreement": STEP,
    "policy": STEP, "sharding": STEP, "state": STEP, "step_checks": STEP, "param_groups": STEP, "qk_clip": STEP,
    "qk_logits": STEP, "report": STEP, "__init__": STEP, "topology": TOP,
}  # fmt: skip
NAMES = {MATH: "math", PLAN: "plan", COMM: "comm", STEP: "step", TOP: "checkpoint/demo"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _layer(module: str) -> int | str:
    top = module.split(".")[0]
    if top == PLANNING:
        return PLANNING
    if top in ("checkpoint", "demo", "testing", "hf", "__main__", "resume_check"):
        return TOP
    assert module in LAYERS, f"muon_dtensor.{module} has no layer: add it to tests/test_layers.py"
    return LAYERS[module]


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
    if t == PLANNING:  # beside the step: planning itself, the step's policy and the top reach it
        return s in (PLANNING, TOP) or source == "policy"
    if s == PLANNING:  # below nothing: planning prices the math and the plan, never talks
        return t in (MATH, PLAN)
    assert isinstance(s, int) and isinstance(t, int)
    return t <= s


def test_no_module_imports_a_higher_layer() -> None:
    broken = [
        f"{s} ({NAMES.get(_layer(s), _layer(s))}) imports {t} ({NAMES.get(_layer(t), _layer(t))})"  # type: ignore[call-overload]
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


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_design_md_names_each_module_in_its_layer(module: str) -> None:
    """Each row of design.md's module table says which layer its modules are in."""
    table = (PACKAGE.parent / "docs" / "design.md").read_text().split("## A step")[0]
    name = (
        module.replace(".", "/") + ".py"
        if not module.startswith("_sharding")
        else module.split(".")[1] + ".py"
    )
    if module == "__init__":
        return
    rows = [line for line in table.splitlines() if line.startswith("|") and f"`{name}`" in line]
    assert rows, f"docs/design.md's module table does not name {name}"
    assert f"**{NAMES[LAYERS[module]]}**" in rows[0], (
        f"{name}: its row does not say **{NAMES[LAYERS[module]]}**"
    )  # type: ignore[index]
