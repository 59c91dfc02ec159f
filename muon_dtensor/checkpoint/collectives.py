"""The checkpoint helpers' collectives: object broadcasts and barriers over the save group, and
``first_error``, which turns one rank's failure into the same exception on every rank so no rank is
left waiting in the next collective for one that raised."""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from ..sharding.runtime.comm import gather_objects, rank_and_size

__all__ = ["barrier", "broadcast_object", "first_error", "gather_objects", "portable", "rank_and_size"]


def _solo(group: dist.ProcessGroup | None) -> bool:
    return rank_and_size(group)[1] == 1


def barrier(group: dist.ProcessGroup | None) -> None:
    if not _solo(group):
        dist.barrier(group=group)


def broadcast_object(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``value`` on every rank (so all ranks take the same decision)."""
    if _solo(group):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def first_error(error: BaseException | None, group: dist.ProcessGroup | None) -> BaseException | None:
    """The error of the first rank of ``group`` (in rank order) that has one, or None when no rank
    has: every rank gets the same answer and can raise it, so no rank is left waiting in the next
    collective for one that raised. Collective (one object gather). The failing rank gets its own
    exception back (with its traceback); an exception that does not survive pickling travels as a
    ``RuntimeError`` with its text."""
    if _solo(group):
        return error
    mine = portable(error)
    errors = gather_objects(mine, group)
    first = next((rank for rank, e in enumerate(errors) if e is not None), None)
    if first is None:
        return None
    return error if first == rank_and_size(group)[0] and mine is error else errors[first]


def portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling unchanged, else a ``RuntimeError`` with its text."""
    if error is None:
        return None
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - any pickling failure: send the text instead
        pass
    return RuntimeError(f"{type(error).__name__}: {error}")
