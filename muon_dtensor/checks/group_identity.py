"""A group that each rank passes on its own (``Muon(step_group=...)``, ``qk_clip_all_``'s
``process_group``) must be the very group its other members passed: the same ranks and the same
communicator. Otherwise the ranks wait, each in its own group, forever: a rank that passed a group
it is not in (torch hands non-members ``GroupMember.NON_GROUP_MEMBER``, ``-100``), a group of
another size, another ``new_group`` over the same ranks.

``agree_group`` checks it over the default group, which every rank can name: first
``together.raise_together`` (any rank's local failure, and ranks that passed no group where others
did), then one integer sum of ``step_scope``'s fingerprint over each rank's group (0 when every
member of every group passed it, and only they), and an object gather only when that sum says
otherwise, to name the group and the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.runtime.comm import fake_refusal, gather_over_scope
from .agreement import scope_entries
from .step_scope import agreed, fingerprint, scope_key, step_scope
from .together import group_of, raise_together, summed
from .validation import refuse_non_member

__all__ = ["agree_group", "agree_step_group", "group_key"]


def group_key(group: Any, name: str) -> tuple:
    """``group`` as plain data that every rank holding it gives alike: its global ranks and its
    communicator's name (a mesh: its shape, dimension names and each axis's communicator). A
    ValueError naming ``name`` for a group this rank is not in, or a fake group that would lie
    (``comm.fake_refusal``)."""
    rank = dist.get_rank()
    refuse_non_member(group, name)
    refusal = fake_refusal(group, name)
    if refusal is not None:  # its sums would hand each rank its own values as everyone's
        raise ValueError(refusal)
    key = scope_key(group)
    if isinstance(group, DeviceMesh):
        comms = tuple(group.get_group(axis).group_name for axis in range(group.ndim))
        key = (key[0], ", ".join(comms), key[2], key[3], key[4])
    else:
        key = (key[0], str(group.group_name), *key[2:])
    if rank not in key[4]:
        raise ValueError(
            f"{name}: rank {rank} passed a group of ranks {list(key[4])}, which does not hold it"
        )
    return key


def agree_group(
    call: str,
    name: str,
    error: BaseException | None,
    key: tuple | None,
    unchanged: str = "Nothing was changed",
) -> None:
    """Collective over the default group: every rank raises the same error when a rank failed
    (``error``), or passed no ``name`` where others did, or when the ranks of some rank's group
    (``key``, from ``group_key``) did not all pass that group. Returns when every group is its
    members' own."""
    raise_together(error, None, call, {name: "given"}, unchanged)
    assert key is not None, "a rank without a key failed above"
    ((sums, _),) = summed(fingerprint([key], dist.get_rank()), [group_of(None)])
    if agreed(sums):
        return
    everyone = gather_over_scope(key, group_of(None))
    raise ValueError(
        f"{call}: ranks disagree about {name}: {_mismatch(everyone)}. Every rank of a group must pass "
        "that very group (one new_group call's result, or one mesh), and only its ranks. " + unchanged
    )


def _mismatch(everyone: Mapping[int, tuple]) -> str:
    passed: dict[tuple, list[int]] = {}
    for rank, key in sorted(everyone.items()):
        passed.setdefault(key, []).append(rank)
    parts = [
        f"the {'mesh' if k[0] == 'mesh' else 'process group'} of ranks {list(k[4])} (communicator "
        f"{k[1]}) was passed by rank(s) {ranks}"
        + (f" but not by {missing}" if (missing := sorted(set(k[4]) - set(ranks))) else "")
        for k, ranks in passed.items()
        if sorted(ranks) != sorted(k[4])
    ]
    return "; ".join(parts) or "their groups"


def agree_step_group(
    group: Any, groups: Sequence[Mapping[str, Any]], ddp_group: Any, error: BaseException | None
) -> None:
    """``Muon(step_group=...)`` at construction, collective over the default group: a rank's own
    failure (``error``), a group it is not in, a parameter on a mesh reaching outside its step
    group, or step groups that are not their members' own: the same error on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    key = None
    if error is None:
        try:
            key = group_key(group, "step_group")
            outside = step_scope(list(scope_entries(groups, ddp_group)), group, explicit=True).outside
            if outside is not None:
                raise ValueError(outside)
        except Exception as e:  # noqa: BLE001 - raised on every rank by agree_group
            error = e
    agree_group("Muon", "step_group", error, key)
