"""Every private torch name the package uses goes through ``muon_dtensor/base/`` (the torch shims:
``compat.py``, ``torch_dist.py``, ``torch_ops.py``), so a torch release that moves one is fixed in one folder. A module
anywhere else that imports a private torch module or name, reads a private attribute of a torch
object, or looks one up by string, fails here with its file and line."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
while not (PACKAGE / "muon_dtensor").is_dir():  # the repository root, from any depth under tests/
    PACKAGE = PACKAGE.parent
PACKAGE = PACKAGE / "muon_dtensor"
BASE = PACKAGE / "base"

# Private names of other libraries the package reads (not torch's), each with its owner.
NOT_TORCH = {
    "_exit": "os._exit: a rank process ends without running atexit handlers",
    "_getframe": "sys._getframe: the user's line for a warning",
    "_Unpickler": "pickle._Unpickler: the pure-Python unpickler a checkpoint's metadata is read with",
    "_shared_state": "accelerate's PartialState",
    "_attn_implementation": "a Hugging Face model config",
}


def _trees() -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _own_names(trees: dict[Path, ast.AST]) -> set[str]:
    """Every name the package itself defines or assigns (its own private attributes are not torch's)."""
    out: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _string_start(node: ast.AST) -> str | None:
    """The text a ``getattr`` name argument starts with: a constant, or an f-string's first part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    if isinstance(node, ast.IfExp):
        return _string_start(node.body) or _string_start(node.orelse)
    return None


def _uses(path: Path, tree: ast.AST, own: set[str]) -> list[str]:
    where = path.relative_to(PACKAGE.parent)
    found = []
    for n in ast.walk(tree):
        text = None
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
            names = [a.name for a in n.names]
            if any(_private(part) for part in n.module.split(".")) or any(map(_private, names)):
                text = f"from {n.module} import {', '.join(names)}"
        elif (
            isinstance(n, ast.ImportFrom) and n.module and {"compat", "torch_ops"} & set(n.module.split("."))
        ):
            if any(_private(a.name) for a in n.names):  # the shims' public aliases, not torch's names
                text = f"from {n.module} import {', '.join(a.name for a in n.names)}"
        elif isinstance(n, ast.Import):
            text = next((f"import {a.name}" for a in n.names if any(map(_private, a.name.split(".")))), None)
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own | set(NOT_TORCH):
            text = f".{n.attr}"
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"):
            start = _string_start(n.args[1]) if len(n.args) > 1 else None
            if start is not None and _private(start) and start not in own | set(NOT_TORCH):
                text = f"{n.func.id}(..., {start!r})"
        if text is not None:
            found.append(f"{where}:{getattr(n, 'lineno', 0)}: {text}")
    return found


def test_no_module_outside_base_uses_a_private_torch_name() -> None:
    trees = _trees()
    own = _own_names(trees)
    found = [use for p, tree in trees.items() if BASE not in p.parents for use in _uses(p, tree, own)]
    assert not found, "private torch names outside muon_dtensor/base/ (add a shim there):\n" + "\n".join(
        found
    )


def test_the_scan_sees_each_kind_of_use() -> None:
    """The scan is not vacuous: each kind of use in a module outside base/ is found."""
    source = (
        "import torch._dynamo\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "from ..base.compat import _StridedShard\n"
        "g = dist.distributed_c10d._get_default_group()\n"
        "s = getattr(t, '_spec', None)\n"
        "op = getattr(torch, f'_foreach_{name}_' if inplace else f'_foreach_{name}')\n"
        "from ..sharding.plan.compat import _StridedShard\n"
    )
    found = _uses(PACKAGE / "optim" / "x.py", ast.parse(source), set())
    lines = sorted(int(line.split(": ", 1)[0].rsplit(":", 1)[1]) for line in found)
    assert lines == list(range(1, 8)), found
