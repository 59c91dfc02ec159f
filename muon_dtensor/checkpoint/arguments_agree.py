"""Arguments of a collective load that must be the same on every rank, checked in one object
gather before anything is read: one rank's ``optimizer_state='fresh'``, a missing optimizer, a
missing file or name, would otherwise load half the state on some ranks and raise or hang on
others. ``agree_save`` does the same for a save's arguments. Both go through ``checks/together.py``, the library's one agreement primitive."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..checks.together import raise_together

__all__ = ["agree", "agree_save"]

T = TypeVar("T")


def agree(
    call: str,
    group: dist.ProcessGroup | None,
    local: Callable[[], tuple[T, dict[str, Any]]],
    **arguments: Any,
) -> T:
    """``local()`` (the rank's own checks: a value and facts derived from it) on every rank, then
    ``raise_together``: every rank raises a ValueError naming each argument or fact whose value
    differs between ranks, or the first failing rank's error. Returns the local value."""
    try:
        value, facts = local()
        error = None
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        value, facts, error = None, {}, e
    raise_together(error, group, call, {**arguments, **facts}, "Nothing was loaded")
    return value  # type: ignore[return-value]


def agree_save(
    group: dist.ProcessGroup | None,
    check: Callable[[], T],
    call: str = "save_checkpoint",
    **arguments: Any,
) -> T:
    """Before a save writes anything: ``check()`` (the local checks, which also build the state to
    save) on every rank, then one ``raise_together`` over the group carrying the failures and the
    arguments (step, root, extra, ...). Ranks may hold different parameters (pipeline stages): the
    checkpoint keys every entry by its FQN. Returns ``check()``."""
    try:
        value, error = check(), None
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        value, error = None, e
    raise_together(error, group, call, arguments, "Nothing was saved")
    return value  # type: ignore[return-value]
