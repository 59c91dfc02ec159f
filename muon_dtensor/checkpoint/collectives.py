"""The checkpoint helpers' collectives: object broadcasts and barriers over the save group. Their
checks together (one rank's failure raised on every rank) go through ``checks/together.py``."""

from __future__ import annotations

import hashlib
from typing import Any

import torch.distributed as dist

from ..sharding.runtime.comm import gather_objects, rank_and_size, simulated

__all__ = ["barrier", "broadcast_object", "gather_objects", "no_process_group", "rank_and_size", "union"]


def no_process_group() -> bool:
    """No default process group: the helpers run DCP in one process (``no_dist``)."""
    return not (dist.is_available() and dist.is_initialized())


def _solo(group: dist.ProcessGroup | None) -> bool:
    return rank_and_size(group)[1] == 1


def barrier(group: dist.ProcessGroup | None) -> None:
    if not (_solo(group) or simulated(group)):
        dist.barrier(group=group)


def broadcast_object(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's ``value`` on every rank (so all ranks take the same decision)."""
    if _solo(group) or simulated(group):  # the fake backend moves no object: this rank's is rank 0's
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def union(keys: set[str], group: dist.ProcessGroup | None) -> set[str]:
    """Every rank's ``keys`` together. Ranks of one stage (or of the whole run, without stages)
    hold the same set: digests first, then one copy per distinct set, so a load does not move
    every rank's key list to every rank."""
    digest = hashlib.blake2b("\n".join(sorted(keys)).encode(), digest_size=16).hexdigest()
    digests = gather_objects(digest, group)
    first = digests.index(digest) == rank_and_size(group)[0]
    out: set[str] = set()
    for part in gather_objects(sorted(keys) if first else None, group):
        out.update(part or ())
    return out
