"""Arguments of a collective load that must be the same on every rank, checked in one object
gather before anything is read: one rank's ``optimizer_state='fresh'``, a missing optimizer, a
missing file or name, would otherwise load half the state on some ranks and raise or hang on
others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from . import collectives

__all__ = ["agree"]

T = TypeVar("T")


def agree(
    call: str,
    group: dist.ProcessGroup | None,
    local: Callable[[], tuple[T, dict[str, Any]]],
    **arguments: Any,
) -> T:
    """``local()`` (the rank's own checks: a value and facts derived from it) on every rank, then
    one gather: every rank raises the first failing rank's error, or a ValueError naming each
    argument or fact whose value differs between ranks. Returns the local value."""
    try:
        value, facts = local()
        error = None
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        value, facts, error = None, {}, e
    mine = ({**arguments, **facts}, collectives.portable(error))
    parts = collectives.gather_objects(mine, group)
    failed = [rank for rank, (_, e) in enumerate(parts) if e is not None]
    if failed:  # this rank's own exception (with its traceback) where it is the first to fail
        raise error if failed[0] == collectives.rank_and_size(group)[0] and error else parts[failed[0]][1]
    differing = [_describe(key, [p[0][key] for p in parts]) for key in parts[0][0] if _differs(key, parts)]
    if differing:
        raise ValueError(
            f"{call}'s arguments differ between the ranks of the group: {'; '.join(differing)}. Pass the "
            "same arguments, model and files on every rank; nothing was loaded"
        )
    return value  # type: ignore[return-value]


def _differs(key: str, parts: list[tuple[dict[str, Any], Any]]) -> bool:
    return any(p[0].get(key) != parts[0][0][key] for p in parts[1:])


def _describe(key: str, values: list[Any]) -> str:
    """Per distinct value, the ranks holding it; for collections, what differs from rank 0's."""
    if all(isinstance(v, (set, frozenset, dict)) for v in values):
        base = set(values[0])
        parts = [
            f"rank {r} {_listed('lacks', base - set(v))}{_listed(' has only', set(v) - base)}".rstrip()
            for r, v in enumerate(values)
            if v != values[0]
        ]
        return f"{key}: " + ", ".join(parts) + " (compared with rank 0)"
    ranks: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        ranks.setdefault(repr(v), []).append(r)
    return f"{key}: " + ", ".join(f"{v} on rank(s) {rs}" for v, rs in ranks.items())


def _listed(what: str, names: set[Any]) -> str:
    if not names:
        return ""
    shown = sorted(map(str, names))
    return f"{what} {', '.join(shown[:8])}" + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
