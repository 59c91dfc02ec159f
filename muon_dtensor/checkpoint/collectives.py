"""The checkpoint helpers' collectives: object broadcasts and barriers over the save group. Their
checks together (one rank's failure raised on every rank) go through ``checks/together.py``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..sharding.runtime.comm import gather_objects, rank_and_size

__all__ = ["barrier", "broadcast_object", "gather_objects", "rank_and_size"]


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
