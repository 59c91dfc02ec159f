"""The promises made on old module paths, kept by a test: every old path in the one table
(``muon_dtensor/base/moved.py``) imports the moved module itself and warns once, naming the new path
and its removal release; the suite fails once ``muon_dtensor.__version__`` reaches a removal release
still in the table. In round 5 the 0.2.0 paths had been promised "for one release" three releases
earlier, with nothing to notice; the 0.6.0 ones did not warn at all."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest

import muon_dtensor
from muon_dtensor.base.moved import KEPT, OldPath

ROOT = Path(muon_dtensor.__file__).parent
TABLE = "muon_dtensor/base/moved.py"


def _release(version: str) -> tuple[int, int, int]:
    """``"0.8.0"`` -> (0, 8, 0); a pre-release of a release (``"0.8.0rc1"``, ``"0.8.dev0"``) counts as it."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    assert found, f"not a release: {version!r}"
    major, minor, micro = found.groups()
    return int(major), int(minor), int(micro or 0)


def _due(kept: Sequence[OldPath], version: str) -> list[str]:
    return [k.old for k in kept if _release(version) >= _release(k.until)]


def test_no_old_path_outlives_its_removal_release() -> None:
    due = _due(KEPT, muon_dtensor.__version__)
    assert not due, (
        f"muon_dtensor {muon_dtensor.__version__} reached the removal release of {due}: delete them from "
        f"{TABLE} and say so in CHANGELOG.md"
    )


def test_the_release_check_can_fail() -> None:
    kept = [OldPath("a.b", "a.c", since="0.6.0", until="0.8.0")]
    assert _due(kept, "0.7.9") == [] and _due(kept, "0.8.0rc1") == ["a.b"] and _due(kept, "1.0") == ["a.b"]


def test_every_entry_names_its_releases_in_order() -> None:
    assert len(KEPT) == len({k.old for k in KEPT}), "an old path listed twice"
    for k in KEPT:
        assert _release(k.since) < _release(k.until) and k.old.startswith("muon_dtensor."), k
        assert not ROOT.parent.joinpath(*k.old.split(".")).with_suffix(".py").exists(), f"a file at {k.old}"


@pytest.mark.parametrize("kept", KEPT, ids=lambda k: k.old)
def test_an_old_path_is_the_new_module_and_warns_once(kept: OldPath) -> None:
    with warnings.catch_warnings():  # an old package's own warning is its own test's
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(kept.old.rpartition(".")[0])
    sys.modules.pop(kept.old, None)  # as in a fresh process (an earlier test may have imported it)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = importlib.import_module(kept.old)
        again = importlib.import_module(kept.old)
    assert first is again is sys.modules[kept.new] and getattr(first.__spec__, "name", None) == kept.new
    told = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
    assert told == [kept.warning()], told
    assert kept.new in told[0] and f"removed in {kept.until}" in told[0]


def test_the_table_is_the_only_place_that_keeps_paths() -> None:
    callers = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "keep_old_paths":
                callers.append(path.relative_to(ROOT.parent).as_posix())
    assert set(callers) == {TABLE}, f"keep_old_paths called outside {TABLE}: move the call into its table"


def test_the_changelog_and_migration_guide_point_to_the_table() -> None:
    unreleased = (ROOT.parent / "CHANGELOG.md").read_text().split("\n## 0.")[0]
    assert TABLE in unreleased
    assert TABLE in (ROOT.parent / "docs" / "migration.md").read_text()


def test_the_old_checkpoint_helpers_path_still_has_both_halves() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from muon_dtensor.checkpoint import helpers  # type: ignore[attr-defined]
    from muon_dtensor.checkpoint import loading, save

    assert (
        helpers.load_checkpoint is loading.load_checkpoint and helpers.save_checkpoint is save.save_checkpoint
    )
    assert not hasattr(save, "load_checkpoint"), "save.py re-exports load_checkpoint again"


def test_an_old_path_never_replaces_a_public_name() -> None:
    """The 0.2.0 path ``muon_dtensor.newton_schulz`` is a module and ``muon_dtensor.newton_schulz`` a
    function: importing the old path used to set the module as the package's attribute, so every
    later ``muon_dtensor.newton_schulz(x)`` in the process called a module."""
    function = muon_dtensor.newton_schulz
    sys.modules.pop("muon_dtensor.newton_schulz", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from muon_dtensor.newton_schulz import newton_schulz  # type: ignore[import-not-found]
    assert muon_dtensor.newton_schulz is function is newton_schulz and callable(function)


def test_moved_names_keep_their_old_imports() -> None:
    """``Owners`` and ``NSSplit`` moved beside the settings they describe (``sharding.plan.build``
    beside the plan's ``Mode``, ``numerics.ns_config``); ``checks.validation`` still has them."""
    from muon_dtensor.checks import validation
    from muon_dtensor.numerics import ns_config
    from muon_dtensor.sharding.plan import build

    assert validation.Owners is build.Owners and validation.OWNERS is build.OWNERS == (
        "auto",
        "mesh",
        "replica",
    )
    assert validation.NSSplit is ns_config.NSSplit
