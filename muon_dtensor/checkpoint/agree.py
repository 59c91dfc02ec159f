"""Arguments of a collective load that must be the same on every rank, checked in one object
gather before anything is read: one rank's ``optimizer_state='fresh'``, a missing optimizer, a
missing file or name, would otherwise load half the state on some ranks and raise or hang on
others. ``agree_save`` does the same for a save: its arguments, and the param groups every rank
must hold alike. Both go through ``checks/together.py``, the library's one agreement primitive."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

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
    model: nn.Module,
    optimizer: Optimizer | None,
    group: dist.ProcessGroup | None,
    check: Callable[[], T],
    call: str = "save_checkpoint",
    **arguments: Any,
) -> T:
    """Before a save writes anything: ``check()`` (the local checks) on every rank, then one
    ``raise_together`` over the group carrying the failures, the arguments (step, root, extra, ...)
    and the param groups every rank must share. A checkpoint keys param groups by their index, so
    ranks whose optimizers hold other parameters (pipeline stages, one optimizer per model part)
    would overwrite each other's groups; that difference gets its own message. Returns ``check()``."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = [
        [names.get(id(p), "?") for p in g["params"]] for g in (optimizer.param_groups if optimizer else [])
    ]
    digest = hashlib.blake2b(repr(mine).encode(), digest_size=8).hexdigest()
    summary = "; ".join(
        f"group {i}: {len(g)} parameter(s), the first {g[0] if g else None}" for i, g in enumerate(mine)
    )
    try:
        value, error = check(), None
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        value, error = None, e
    facts = {"param groups": summary, "their parameters": digest, **arguments}
    try:
        raise_together(error, group, call, facts, "Nothing was saved")
    except ValueError as e:
        if "param groups:" not in str(e) and "their parameters:" not in str(e):
            raise
        why = str(e).split(". Pass the same")[0].removeprefix(f"{call}: ranks disagree about ")
        raise ValueError(
            f"{call}: the ranks' optimizers hold different param groups ({why}), as pipeline "
            "stages do (one optimizer per model part). This checkpoint keys param groups by their index, "
            "so one rank's groups would overwrite another's and no run could load it; nothing was saved. "
            "Save pipeline stages with torch.distributed.checkpoint and per-parameter optimizer keys "
            "(StateDictOptions(flatten_optimizer_state_dict=True)), as docs/torchtitan.md ('Pipeline "
            "parallelism') shows"
        ) from None
    return value  # type: ignore[return-value]
