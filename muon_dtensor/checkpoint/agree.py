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

from . import collectives

__all__ = ["agree", "same_groups"]

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
    parts = collectives.gather_objects((digest, summary), group)
    other = next((r for r, (d, _) in enumerate(parts) if d != parts[0][0]), None)
    if other is not None:
        raise ValueError(
            f"save_checkpoint: the ranks' optimizers hold different param groups (rank 0: {parts[0][1] or 'none'}; "
            f"rank {other}: {parts[other][1] or 'none'}), as pipeline stages do (one optimizer per model part). "
            "This checkpoint keys param groups by their index, so one rank's groups would overwrite another's "
            "and no run could load it; nothing was saved. Save pipeline stages with torch.distributed.checkpoint "
            "and per-parameter optimizer keys (StateDictOptions(flatten_optimizer_state_dict=True)), as "
            "docs/torchtitan.md ('Pipeline parallelism') shows"
        )
