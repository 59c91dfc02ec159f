"""Old module paths kept importable after a module moved, and the one table of them.

The old path imports the moved module itself, on first use, with no file left at the old path, so
``import muon_dtensor.checks.names`` costs nothing until someone imports it, and git follows the
move as a rename. Its first import in a process warns (a DeprecationWarning) naming the new path and
the release that removes the old one; later imports find it in ``sys.modules`` and stay quiet.

The calls at the bottom of this file are the table of every old path (CHANGELOG.md and
docs/migration.md point here); ``tests/base/test_moved.py`` fails once ``muon_dtensor.__version__``
reaches a removal release still listed, and on a ``keep_old_paths`` call anywhere else."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["KEPT", "OldPath", "keep_old_paths"]


@dataclass(frozen=True)
class OldPath:
    """One kept path: ``old`` imports the module ``new`` (full dotted names) from release ``since``
    until release ``until``, which removes it."""

    old: str
    new: str
    since: str
    until: str

    def warning(self) -> str:
        return (
            f"{self.old} moved to {self.new} in {self.since} and the old path is removed in "
            f"{self.until}; import {self.new}"
        )


KEPT: list[OldPath] = []  # every path kept, in the order of the calls


class _KeepsItsNames(ModuleType):
    """A package whose names an old path cannot replace: the import system sets each module it
    imports as an attribute of its parent, and the 0.2.0 path ``muon_dtensor.newton_schulz`` would
    replace the function ``muon_dtensor.newton_schulz`` by a module. Refused, the import system
    only issues an ImportWarning (ignored by default)."""

    def __setattr__(self, name: str, value: object) -> None:
        held = self.__dict__.get(name)
        if isinstance(value, ModuleType) and held is not None and not isinstance(held, ModuleType):
            raise AttributeError(f"{self.__name__}.{name} stays {held!r}")
        super().__setattr__(name, value)


class _Alias(importlib.abc.Loader):
    """Loads the old path as the new module object (already run under its own name)."""

    def __init__(self, kept: OldPath) -> None:
        self.kept = kept
        self.spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        # stacklevel 2 skips importlib's own frames (warnings does), so the user's import line shows
        warnings.warn(self.kept.warning(), DeprecationWarning, stacklevel=2)
        parent = sys.modules[spec.name.rpartition(".")[0]]
        if type(parent) is ModuleType:
            parent.__class__ = _KeepsItsNames
        module = importlib.import_module(self.kept.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import machinery gave it the old path's spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def __init__(self, kept: Sequence[OldPath]) -> None:
        self.kept = {k.old: k for k in kept}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        kept = self.kept.get(fullname)
        return None if kept is None else importlib.util.spec_from_loader(fullname, _Alias(kept))


def keep_old_paths(package: str, moves: Mapping[str, str], *, since: str, until: str) -> None:
    """Make ``package.<old>`` import the module ``<new>`` (a full dotted name) for each old -> new,
    warning on its first import that it moved in release ``since`` and goes in release ``until``."""
    kept = [OldPath(f"{package}.{old}", new, since, until) for old, new in moves.items()]
    KEPT.extend(kept)
    # First: an old package's submodule would otherwise be found on the new package's path and run
    # a second time under the old name.
    sys.meta_path.insert(0, _OldPaths(kept))


# The table. Users asked for the 0.2.0 paths back in round 5, so they stay until 0.8.0 with the rest.
_TOP = "muon_dtensor"
_V0_2 = {
    "hf": "integrations.hf",
    "resume_check": "tools.resume_check",
    "topology": "tools.topology",
    "qk_clip": "features.qk_clip",
    "qk_logits": "features.qk_logits",
    **{m: f"numerics.{m}" for m in ("newton_schulz", "split_ns", "elementwise", "normuon")},
    **{m: f"optim.{m}" for m in ("optimizer", "functional", "state", "policy", "report", "param_groups")},
    **{m: f"checks.{m}" for m in ("validation", "preflight", "agreement", "step_checks")},
    "_sharding": "sharding",
    **{f"_sharding.{m}": f"sharding.plan.{m}" for m in ("blocks", "param_layout", "views", "routes", "runs")},
    **{f"_sharding.{m}": f"sharding.plan.{m}" for m in ("gangs", "domains", "owners", "memory")},
    "_sharding.plan": "sharding.plan.build",
    **{f"_sharding.{m}": f"sharding.runtime.{m}" for m in ("comm", "groups", "exchange", "split_exchange")},
    "_compat": "base.compat",
}
_V0_6 = {
    "sharding.plan.compat": "base.compat",
    "checks.names": "base.names",
    "checks.warn": "base.warn",
    "checkpoint.helpers": "checkpoint",  # save and load were one module: their names are the package's
    "checkpoint.layout": "checkpoint.keys",
    "checkpoint.agree": "checkpoint.arguments_agree",
    "tools.testing": "testing.runner",
    "tools.launcher": "testing.launcher",
    "tools.rank": "testing.rank",
}
keep_old_paths(_TOP, {old: f"{_TOP}.{new}" for old, new in _V0_2.items()}, since="0.2.0", until="0.8.0")
keep_old_paths(_TOP, {old: f"{_TOP}.{new}" for old, new in _V0_6.items()}, since="0.6.0", until="0.8.0")
