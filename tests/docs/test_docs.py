"""The documentation matches the code.

docs/api.md: each ``##`` section names its module first, in backticks; each code block marked
``python`` lists one entry per name: ``name(args) -> annotation``, ``Class.method(args) -> ...``
(without ``self``) or a bare name. Every entry must import, and its parameters (names, kinds,
defaults) and return annotation must be the code's; every name in the ``__all__`` of a module named
there must be listed. Blocks marked ``py`` are examples and must parse.

README.md: the benchmark table is ``benchmarks/results/bench_step_run4.json``, ratio for ratio, and
every "N.NNx" ratio in the README, docs/migration.md and docs/comparison.md (the README's comparison
table, moved there) is one of that file's; the H200 figures are the cost model's; the test command
installs the Hugging Face extra.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
RESULTS = "benchmarks/results/bench_step_run4.json"


@dataclass(frozen=True)
class Entry:
    module: str
    name: str  # "f", "Class" or "Class.method"
    params: str | None  # "(a, b=1) -> int", or None for a bare name
    line: int

    @property
    def id(self) -> str:
        return f"{self.module}:{self.name}"


def _blocks(text: str) -> list[tuple[str | None, str, str, int]]:
    """(module of the enclosing ## section, language, body, line of the body) of every fenced block."""
    out, module, fence, body, start = [], None, None, [], 0
    for i, line in enumerate(text.splitlines(), 1):
        if fence is not None:
            if line.strip() == "```":
                out.append((module, fence, "\n".join(body), start))
                fence, body = None, []
            else:
                body.append(line)
        elif line.startswith("```"):
            fence, start = line[3:].strip(), i + 1
        elif line.startswith("## "):
            found = re.match(r"## `([\w.]+)`", line)
            module = found.group(1) if found else None
    assert fence is None, "an unclosed code block in docs/api.md"
    return out


def _entries(module: str | None, body: str, start: int) -> list[Entry]:
    """Split a signature block: an entry starts at column 0, continuation lines are indented."""
    assert module, f"docs/api.md line {start}: a signature block outside a `## `module`` section"
    pieces: list[tuple[int, list[str]]] = []
    for offset, line in enumerate(body.splitlines()):
        if line.strip() and not line[0].isspace():
            pieces.append((start + offset, [line]))
        elif line.strip():
            pieces[-1][1].append(line.strip())
    out = []
    for line_no, lines in pieces:
        text = " ".join(lines)
        match = re.fullmatch(r"([A-Za-z_][\w.]*)(\(.*)?", text)
        assert match, f"docs/api.md line {line_no}: not a signature: {text!r}"
        out.append(Entry(module, match.group(1), match.group(2), line_no))
    return out


def _api() -> tuple[list[Entry], list[tuple[str, int]]]:
    """Signature entries and (example, line) pairs of docs/api.md."""
    entries, examples = [], []
    for module, lang, body, start in _blocks(API.read_text()):
        if lang == "python":
            entries += _entries(module, body, start)
        elif lang == "py":
            examples.append((body, start))
    return entries, examples


ENTRIES, EXAMPLES = _api()


_MISSING = object()


def _resolve(entry: Entry) -> tuple[Any, Any]:
    """(owner class or module, the object) that an entry names; None for a dataclass field."""
    owner: Any = importlib.import_module(entry.module)
    *path, last = entry.name.split(".")
    for part in path:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            pytest.fail(f"docs/api.md line {entry.line}: {entry.module} has no {entry.name}")
    if dataclasses.is_dataclass(owner) and last in {f.name for f in dataclasses.fields(owner)}:
        return owner, None
    if inspect.ismodule(owner):
        getattr(owner, last, None)  # a lazy name (the package's __getattr__) loads on first access
    obj = inspect.getattr_static(owner, last, _MISSING)
    if obj is _MISSING:
        pytest.fail(f"docs/api.md line {entry.line}: {entry.module} has no {entry.name}")
    return owner, obj


def _actual(owner: Any, obj: Any) -> tuple[inspect.Signature, bool]:
    """The signature as a caller sees it (no ``self``), and whether the object is a class."""
    if inspect.isclass(obj):
        return inspect.signature(obj), True
    if isinstance(obj, staticmethod):
        return inspect.signature(obj.__func__), False
    if isinstance(obj, classmethod):
        return inspect.signature(obj.__get__(None, owner)), False
    sig = inspect.signature(obj)
    if inspect.isclass(owner):  # a plain method looked up on its class: drop self
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig, False


def _documented(params: str) -> ast.FunctionDef:
    tree = ast.parse(f"def _{params}:\n    pass\n")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def _doc_params(fn: ast.FunctionDef) -> list[tuple[str, str, ast.expr | None]]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [
        (arg.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", default)
        for i, (arg, default) in enumerate(zip(positional, defaults))
    ]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(arg.arg, "KEYWORD_ONLY", default) for arg, default in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out


def _normal(annotation: Any) -> str:
    """An annotation as source text, spaced the way ``ast.unparse`` spaces it."""
    if annotation is inspect.Signature.empty or annotation is None:
        return "None"
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return ast.unparse(ast.parse(text, mode="eval").body)


def _default_problems(entry: Entry, doc: ast.expr | None, actual: Any, name: str) -> list[str]:
    empty = inspect.Parameter.empty
    if doc is None and actual is empty:
        return []
    if doc is None or actual is empty:
        shown = "no default" if doc is None else f"default {ast.unparse(doc)}"
        return [f"{name}: documented with {shown}, the code's default is {actual!r}"]
    module = importlib.import_module(entry.module)
    exported = {name: getattr(module, name) for name in getattr(module, "__all__", ())}  # loads lazy ones
    namespace = {"torch": torch, **vars(module), **exported}
    value = eval(compile(ast.Expression(doc), str(API), "eval"), namespace)  # noqa: S307
    if type(value) is not type(actual) or value != actual:
        return [f"{name}: documented default {ast.unparse(doc)} = {value!r}, the code's is {actual!r}"]
    return []


def _signature_problems(entry: Entry, owner: Any, obj: Any) -> list[str]:
    assert entry.params is not None
    sig, is_class = _actual(owner, obj)
    fn = _documented(entry.params)
    doc = _doc_params(fn)
    code = [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]
    if [(n, k) for n, k, _ in doc] != [(n, k) for n, k, _ in code]:
        return [f"parameters {[(n, k) for n, k, _ in doc]} vs the code's {[(n, k) for n, k, _ in code]}"]
    problems = [p for (n, _, d), (_, _, a) in zip(doc, code) for p in _default_problems(entry, d, a, n)]
    documented = _normal(ast.unparse(fn.returns) if fn.returns else None)
    if is_class and fn.returns is not None:
        problems.append("a class is documented without a return annotation")
    elif not is_class and documented != _normal(sig.return_annotation):
        problems.append(f"returns {documented}, the code's {_normal(sig.return_annotation)}")
    return problems


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.id)
def test_documented_names_exist_with_their_signatures(entry: Entry) -> None:
    owner, obj = _resolve(entry)
    if entry.params is None:
        return  # a bare name: existing is all it claims
    if obj is None or isinstance(obj, property):
        pytest.fail(f"docs/api.md line {entry.line}: {entry.name} is an attribute, documented as callable")
    problems = _signature_problems(entry, owner, obj)
    assert not problems, f"docs/api.md line {entry.line}, {entry.id}: " + "; ".join(problems)


def _object(entry: Entry) -> Any:
    """What an entry names, or None when it names nothing (the test above reports that)."""
    owner: Any = importlib.import_module(entry.module)
    for part in entry.name.split("."):
        owner = getattr(owner, part, None)
    return owner


def test_every_exported_name_of_a_documented_module_is_documented() -> None:
    documented = {id(_object(e)) for e in ENTRIES}
    modules: dict[str, ModuleType] = {e.module: importlib.import_module(e.module) for e in ENTRIES}
    missing = [
        f"{name}.{export}"
        for name, module in sorted(modules.items())
        for export in getattr(module, "__all__", ())
        if id(getattr(module, export)) not in documented
    ]
    assert not missing, f"in __all__ but not in docs/api.md: {missing}"


def test_api_md_covers_the_public_packages() -> None:
    covered = {e.module for e in ENTRIES}
    for module in (
        "muon_dtensor",
        "muon_dtensor.checkpoint",
        "muon_dtensor.checkpoint.manifest",
        "muon_dtensor.checkpoint.safetensors",
        "muon_dtensor.planning.costmodel",
        "muon_dtensor.planning.hardware",
        "muon_dtensor.tools.plan_command",
        "muon_dtensor.demo",
        "muon_dtensor.testing",
    ):
        assert module in covered, f"docs/api.md has no section for {module}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: f"line{e[1]}")
def test_examples_parse(example: tuple[str, int]) -> None:
    ast.parse(example[0], filename=f"docs/api.md, line {example[1]}")


# ----------------------------------------------------------------------------------- README


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _results() -> dict[tuple[str, int], float]:
    rows = json.loads((ROOT / RESULTS).read_text())["rows"]
    return {(r["contender"], r["ranks"]): r["ratio"] for r in rows}


def test_readme_benchmark_table_is_the_results_file() -> None:
    section = _section(README.read_text(), "Benchmarks")
    assert f"`{RESULTS}`" in section, "the README names the results file its table comes from"
    table = {
        (contender, int(ranks)): ratio
        for contender, ranks, ratio in re.findall(r"^\| (.+?) \| (\d+) \| \**([\d.]+)\** \|$", section, re.M)
    }
    results = _results()
    assert table.keys() == results.keys()
    for key, ratio in results.items():
        assert table[key] == f"{ratio:.2f}", f"README: {key} is {table[key]}, {RESULTS} says {ratio:.2f}"


@pytest.mark.parametrize("doc", ["README.md", "docs/migration.md", "docs/comparison.md"])
def test_ratios_in_prose_come_from_the_results_file(doc: str) -> None:
    allowed = {f"{ratio:.2f}" for ratio in _results().values()}
    found = re.findall(r"\b(\d\.\d\d)x\b", (ROOT / doc).read_text())
    assert found, f"{doc} quotes no ratio; drop this check if that is intended"
    assert set(found) <= allowed, f"{doc}: ratios {sorted(set(found) - allowed)} are not in {RESULTS}"


def test_readme_h200_figures_are_the_cost_models() -> None:
    from muon_dtensor.planning.costmodel import LLAMA3_8B, predict

    text = " ".join(_section(README.read_text(), "Benchmarks").split())
    match = re.search(r"(\d+) ms for Llama-3-8B's Muon step on 8 H200s and (\d+) ms on 64", text)
    assert match, "the README's cost-model sentence changed; update this test with it"
    assert int(match.group(1)) == round(predict(LLAMA3_8B, 8).total * 1e3)
    assert int(match.group(2)) == round(predict(LLAMA3_8B, 64).total * 1e3)


def test_readme_test_command_installs_what_the_tests_need() -> None:
    block = re.search(r"Set up and run the tests.*?```bash\n(.+?)\n```", README.read_text(), re.S)
    assert block, "README.md lost its 'Set up and run the tests' command (.ci/run runs it)"
    command = block.group(1)
    assert "pip install torch==" in command and "'.[test,hf,lightning]'" in command
    assert command.endswith("&& .venv/bin/python -m pytest -q")


def test_the_agreed_settings_are_listed_in_unsupported_md() -> None:
    from muon_dtensor.checks.agreement import AGREED_KEYS

    text = " ".join((ROOT / "docs" / "unsupported.md").read_text().split())
    listed = re.search(r"the same settings: (.+?)\. Cost", text)
    assert listed, "docs/unsupported.md lost its list of the settings ranks must agree on"
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(AGREED_KEYS)
