"""Arguments of a collective load that must be the same on every rank, checked in one object
gather before anything is read: one rank's ``optimizer_state='fresh'``, a missing optimizer, a
missing file or name, would otherwise load half the state on some ranks and raise or hang on
others. ``same_groups`` does the same for a save: every rank must hold the same param groups."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..checks.together import raise_together

__all__ = ["agree", "same_groups"]

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


def same_groups(model: nn.Module, optimizer: Optimizer | None, group: dist.ProcessGroup | None) -> None:
    """One gather before a save: a checkpoint keys param groups by their index, so ranks whose
    optimizers hold other parameters (pipeline stages, one optimizer per model part) would overwrite
    each other's groups and write a checkpoint no run could load. Raises the same ValueError on
    every rank, before any file is written."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = [
        [names.get(id(p), "?") for p in g["params"]] for g in (optimizer.param_groups if optimizer else [])
    ]
    digest = hashlib.blake2b(repr(mine).encode(), digest_size=8).hexdigest()
    summary = "; ".join(
        f"group {i}: {len(g)} parameter(s), the first {g[0] if g else None}" for i, g in enumerate(mine)
    )
    try:
        raise_together(None, group, "save_checkpoint", {"param groups": summary, "their parameters": digest})
    except ValueError as e:
        why = str(e).split(". Pass the same")[0].removeprefix("save_checkpoint: ranks disagree about ")
        raise ValueError(
            f"save_checkpoint: the ranks' optimizers hold different param groups ({why}), as pipeline "
            "stages do (one optimizer per model part). This checkpoint keys param groups by their index, "
            "so one rank's groups would overwrite another's and no run could load it; nothing was saved. "
            "Save pipeline stages with torch.distributed.checkpoint and per-parameter optimizer keys "
            "(StateDictOptions(flatten_optimizer_state_dict=True)), as docs/torchtitan.md ('Pipeline "
            "parallelism') shows"
        ) from None
