"""The one way ranks check together. Every public call that communicates (``Muon.step``, group
construction, ``qk_clip_``/``qk_clip_all_``, the checkpoint helpers) goes through here before its
first other collective, so a bad input, a disagreement or an earlier failure is the same error on
every rank, never a hang or a silent mix:

- ``raise_together(error, scope, call, arguments)``: one integer sum over the scope carries
  ``[1, failed, digest pieces, their squares]``. Only when it says something is wrong does one object
  gather bring the first failing rank's error, or the arguments that differ, to every rank.
- ``summed(row, scopes)``: the same integer sum for callers that add counts of their own (the step's
  checks add the gradients' presence digests to the row).
- ``refuse_after_failure(call)``: once a step failed inside its data path on any rank, every later
  call raises at once with that failure, until the process group is re-created (the ranks' states
  differ and gloo may still hold the failed step's unmatched collectives).

The sums wait in slices (``failures.wait_released``), so a rank whose peer refused or failed raises too.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..base.torch_dist import default_group
from ..sharding.runtime.comm import gather_over_scope, rank_and_size, sum_over_scopes
from ..sharding.runtime.failures import job_failure

__all__ = [
    "Scope",
    "attempt",
    "digest_pieces",
    "group_of",
    "raise_together",
    "refuse_after_failure",
    "summed",
]

Scope = DeviceMesh | dist.ProcessGroup | None  # None: the default group (every rank can name it)
T = TypeVar("T")


def digest_pieces(text: str) -> list[int]:
    """A 63-bit digest of ``text`` in three 21-bit pieces: sums over 2^20 ranks stay exact."""
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1
    return [(digest >> (21 * i)) & ((1 << 21) - 1) for i in range(3)]


def disagree(n: int, sums: Sequence[int], squares: Sequence[int]) -> bool:
    """All n ranks hold the same digest iff n * sum(x^2) == sum(x)^2 for each of its pieces."""
    return any(n * sq != s * s for s, sq in zip(sums, squares))


def refuse_after_failure(call: str) -> None:
    """Raise at once if a step failed inside its data path since the process group was created."""
    failure = job_failure()
    if failure is not None:
        raise RuntimeError(
            f"{call}: refused, since an earlier Muon.step failed inside its data path ({failure}). "
            "The ranks' parameters and optimizer states may now differ, and the process group may "
            "still hold that step's unmatched collectives, so no step or checkpoint can run on it. "
            "Re-create the process group (destroy_process_group, then init_process_group) or "
            "relaunch, and resume from the last complete checkpoint"
        )


def summed(
    row: Sequence[int], scopes: Sequence[DeviceMesh | dist.ProcessGroup]
) -> list[tuple[list[int], int]]:
    """``row`` (integers) summed over each scope in turn, with the scope's rank count. Collective over
    every scope, in the order given; its callers (``Muon.step``, ``raise_together``) refuse after a
    failure first."""
    head = torch.tensor(list(row), dtype=torch.int64)
    return [(sums.tolist(), size) for sums, size in sum_over_scopes(head, scopes)]


def _size(scope: Scope) -> int:
    if isinstance(scope, DeviceMesh):
        return scope.size()
    return rank_and_size(scope)[1]


def group_of(scope: Scope) -> DeviceMesh | dist.ProcessGroup:
    """The mesh or group a scope names (None: the default group)."""
    return scope if scope is not None else default_group()


def raise_together(
    error: BaseException | None,
    scope: Scope,
    call: str,
    arguments: Mapping[str, Any] | None = None,
    unchanged: str = "Nothing was changed",
) -> None:
    """Collective over ``scope``: every rank raises the first failing rank's error (this rank's own,
    with its traceback, where it is that rank), or a ValueError naming each of ``arguments`` whose
    value differs between ranks (checked first: a failure may follow from it; ``unchanged`` ends that
    message). Returns on every rank when no rank failed and all agree."""
    refuse_after_failure(call)
    if _size(scope) == 1:
        if error is not None:
            raise error
        return
    shown = {k: _plain(v) for k, v in (arguments or {}).items()}
    pieces = digest_pieces(repr(sorted(shown.items(), key=lambda kv: kv[0])))
    row = [1, int(error is not None), *pieces, *(x * x for x in pieces)]
    ((sums, size),) = summed(row, [group_of(scope)])
    if not sums[1] and not disagree(size, sums[2:5], sums[5:8]):
        return
    portable = _portable(error)  # the error itself, or a RuntimeError with its text
    everyone = gather_over_scope((shown, portable), group_of(scope))
    keys = dict.fromkeys(k for _, (a, _) in sorted(everyone.items()) for k in a)  # every rank's, in one order
    if any(
        e is not None for _, e in everyone.values()
    ):  # a failing rank's facts may be missing: not a difference
        keys = {k: None for k in keys if all(k in a for a, _ in everyone.values())}
    common = [k for k in keys if all(k in a for a, _ in everyone.values())]
    differing = [  # first what every rank named (ranks in different calls share few keys)
        d for d in (_describe(k, {r: a.get(k) for r, (a, _) in everyone.items()}) for k in common) if d
    ] or [d for d in (_describe(k, {r: a.get(k) for r, (a, _) in everyone.items()}) for k in keys) if d]
    if differing:  # the root cause: a failure on some rank may follow from it
        raise ValueError(
            f"{call}: ranks disagree about {'; '.join(differing)}. Pass the same arguments, model and "
            f"files on every rank. {unchanged}"
        )
    failed = [rank for rank, (_, e) in sorted(everyone.items()) if e is not None]
    if failed:
        own = failed[0] == dist.get_rank() and error is not None and portable is error
        raise error if own and error is not None else everyone[failed[0]][1]
    raise RuntimeError(  # a rank of a 2-D mesh that shares no axis with this one
        f"{call} failed or disagreed on {max(sums[1], 1)} other rank(s) of its mesh; their error names the value"
    )


def attempt(work: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``work()`` and None, or None and the exception it raised (for ``raise_together``)."""
    try:
        return work(), None
    except Exception as e:  # noqa: BLE001 - handed to raise_together, raised on every rank
        return None, e


def _plain(value: Any) -> Any:
    """An argument as comparable plain data (sets sorted, tensors by shape and dtype)."""
    if isinstance(value, (set, frozenset)):
        return frozenset(map(_plain, value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def _portable(error: BaseException | None) -> BaseException | None:
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


def _describe(key: str, values: Mapping[int, Any]) -> str:
    """Per distinct value, the ranks holding it; for sets and dicts, what differs from the lowest rank's."""
    ordered = [values[r] for r in sorted(values)]
    if all(v == ordered[0] for v in ordered):
        return ""
    if all(isinstance(v, (frozenset, dict)) for v in ordered) and any(
        set(v) != set(ordered[0]) for v in ordered
    ):
        base = set(ordered[0])
        parts = [
            f"rank {r} {_listed('lacks', base - set(v))}{_listed(' has only', set(v) - base)}".rstrip()
            for r, v in sorted(values.items())
            if v != ordered[0]
        ]
        return f"{key}: " + ", ".join(parts) + f" (compared with rank {min(values)})"
    ranks: dict[str, list[int]] = {}
    for r, v in sorted(values.items()):
        ranks.setdefault(repr(v), []).append(r)
    return f"{key}: " + ", ".join(
        f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for v, rs in ranks.items()
    )


def _listed(what: str, names: set[Any]) -> str:
    if not names:
        return ""
    shown = sorted(map(str, names))
    return f"{what} {', '.join(shown[:8])}" + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")
