"""The Newton-Schulz settings live with Newton-Schulz: ``numerics/ns_config.py`` resolves them, and
a new variant touches ``numerics/`` plus the ``plan`` flag's help and the ``Muon`` docstring only
(CONTRIBUTING.md, "Adding a Newton-Schulz variant")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import muon_dtensor
from muon_dtensor.checks import validation
from muon_dtensor.numerics import newton_schulz, ns_config
from muon_dtensor.tools import plan_flags

ROOT = Path(__file__).resolve().parents[1]
while not (
    ROOT / "muon_dtensor"
).is_dir():  # the tests' folder depth may change; the repo root holds the package
    ROOT = ROOT.parent
PACKAGE = ROOT / "muon_dtensor"


def test_the_resolver_and_its_tables_are_defined_in_numerics() -> None:
    """checks/ calls the resolver; it does not hold it (it re-exports the same objects)."""
    for name in ("resolve_ns_config", "ns_dtype_name", "_check_aol_preset", "_as_triple"):
        assert getattr(ns_config, name).__module__ == "muon_dtensor.numerics.ns_config", name
    assert muon_dtensor.resolve_ns_config is ns_config.resolve_ns_config
    assert validation.resolve_ns_config is ns_config.resolve_ns_config
    assert validation.ns_dtype_name is ns_config.ns_dtype_name
    tree = ast.parse((PACKAGE / "checks" / "validation.py").read_text())
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not defined & {"resolve_ns_config", "ns_dtype_name", "_check_aol_preset", "_as_triple"}


def test_every_algorithm_has_its_note_and_the_cli_offers_it() -> None:
    """One list of algorithms (``newton_schulz.NSAlgorithm``): the refusal's notes and ``plan
    --ns-algorithm`` follow it, so neither needs an edit for a new variant."""
    assert set(ns_config.ALGORITHM_NOTES) == set(newton_schulz.ALGORITHMS)
    p = plan_flags.parser(["llama3-8b"])
    action = next(a for a in p._actions if "--ns-algorithm" in a.option_strings)
    assert tuple(action.choices or ()) == newton_schulz.ALGORITHMS
    with pytest.raises(ValueError, match=r"ns_algorithm should be 'standard', 'gram' or 'aol' but is: 'x'"):
        ns_config.resolve_ns_config("keller", 5, 1e-7, torch.bfloat16, "x")


def _constants_equal_to(value: str) -> set[str]:
    """The package modules holding ``value`` as a string constant (docstrings and help text aside)."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == value:
                out.add(str(path.relative_to(PACKAGE)))
    return out


def test_the_last_variant_added_is_named_only_in_numerics() -> None:
    """AOL, added as a variant priced like the standard iteration, is spelled out as a value in
    ``numerics/`` alone: no check, agreement key, plan cache or CLI list names it. (Its help text and
    docstring are prose, not constants.) A new variant follows the same path."""
    places = _constants_equal_to("aol")
    assert places and all(p.startswith("numerics/") for p in places), sorted(places)
