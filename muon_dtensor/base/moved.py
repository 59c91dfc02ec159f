"""Old module paths kept importable for one release after a module moved (CHANGELOG.md lists them).
The old path imports the moved module itself, on first use, with no file left at the old path, so
``import muon_dtensor.checks.names`` costs nothing until someone imports it, and git follows the
move as a rename. Given the release it moved in (``since``), an import of the old path warns with a
DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["keep_old_paths"]


class _Alias(importlib.abc.Loader):
    """Loads the old path as the new module object (already run under its own name)."""

    def __init__(self, target: str, since: str | None) -> None:
        self.target, self.since = target, since
        self.spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        if self.since is not None:
            warnings.warn(
                f"{spec.name} moved to {self.target} in {self.since}; import {self.target} (the old "
                "path goes in the next release)",
                DeprecationWarning,
                stacklevel=2,
            )
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import machinery gave it the old path's spec


class _OldPaths(importlib.abc.MetaPathFinder):
    def __init__(self, moves: Mapping[str, str], since: str | None) -> None:
        self.moves, self.since = dict(moves), since

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        new = self.moves.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new, self.since))


def keep_old_paths(package: str, moves: Mapping[str, str], since: str | None = None) -> None:
    """Make ``package.<old>`` import the module ``<new>`` (a full dotted name) for each old -> new;
    with ``since``, warn on each such import."""
    # First: an old package's submodule would otherwise be found on the new package's path and run
    # a second time under the old name.
    sys.meta_path.insert(0, _OldPaths({f"{package}.{old}": new for old, new in moves.items()}, since))
