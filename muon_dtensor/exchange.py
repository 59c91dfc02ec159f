"""Run a plan: blocks to their owners, Newton-Schulz once per matrix, results back to every block.

For one batch of same-shape matrices, on group rank ``me``:
  1. send my block of every matrix to its owner (gather mode: to every rank): one all-to-all;
  2. assemble each matrix I own from the blocks, in global index order;
  3. orthogonalize my matrices as one batch;
  4. send every rank its block of each result (gather mode: slice locally): one all-to-all.
Assembly and slicing follow the plan's blocks, so any layout that the layout module can describe is
exchanged the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CommStats, all_to_all_chunks
from .layout import Block, block_numel, block_shape
from .plan import EVERYONE, Batch, Plan

__all__ = ["run_plan"]

Orthogonalize = Callable[[Tensor], Tensor]


def _pieces(block: Block) -> list[tuple[slice, slice, slice, slice]]:
    """(global rows, global cols, local rows, local cols) of each rectangle of a 2-D block."""
    out = []
    local_r = 0
    for r0, r1 in block[0]:
        local_c = 0
        for c0, c1 in block[1]:
            out.append(
                (
                    slice(r0, r1),
                    slice(c0, c1),
                    slice(local_r, local_r + r1 - r0),
                    slice(local_c, local_c + c1 - c0),
                )
            )
            local_c += c1 - c0
        local_r += r1 - r0
    return out


def _assemble(full: Tensor, block: Block, flat: Tensor) -> None:
    local = flat.view(block_shape(block))
    for gr, gc, lr, lc in _pieces(block):
        full[gr, gc] = local[lr, lc]


def _cut(full: Tensor, block: Block) -> Tensor:
    pieces = _pieces(block)
    if len(pieces) == 1:
        gr, gc, _, _ = pieces[0]
        return full[gr, gc]
    local = full.new_empty(block_shape(block))
    for gr, gc, lr, lc in pieces:
        local[lr, lc] = full[gr, gc]
    return local


def _to_owners(
    plan: Plan,
    batch: Batch,
    me: int,
    local: dict[int, Tensor],
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
) -> Tensor:
    """Steps 1-2: the full matrices this rank owns in ``batch``, stacked ``[k, m, n]``."""
    mine = batch.owned_by(me)
    if group is None:
        return torch.stack([local[m] for m in mine])
    size = plan.group_size
    sends: list[list[Tensor]] = [[] for _ in range(size)]
    for member, owner in zip(batch.members, batch.owners):
        for dest in range(size) if owner == EVERYONE else (owner,):
            sends[dest].append(local[member])
    recv_numels = [sum(block_numel(plan.entries[m].blocks[src]) for m in mine) for src in range(size)]
    sample = local[batch.members[0]]
    received = all_to_all_chunks(
        sends, recv_numels, group=group, dtype=sample.dtype, device=sample.device, stats=stats
    )
    fulls = sample.new_empty((len(mine), *plan.entries[batch.members[0]].shape))
    for src in range(size):
        offset = 0
        for k, member in enumerate(mine):
            block = plan.entries[member].blocks[src]
            _assemble(fulls[k], block, received[src][offset : offset + block_numel(block)])
            offset += block_numel(block)
    return fulls


def _to_blocks(
    plan: Plan,
    batch: Batch,
    me: int,
    results: Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
) -> dict[int, Tensor]:
    """Step 4: my block of every matrix of ``batch``, cut from the owners' results."""
    mine = batch.owned_by(me)
    if plan.mode == "gather" or group is None:
        return {m: _cut(results[k], plan.entries[m].blocks[me]) for k, m in enumerate(mine)}
    size = plan.group_size
    back = [[_cut(results[k], plan.entries[m].blocks[d]) for k, m in enumerate(mine)] for d in range(size)]
    from_owner = [
        sum(block_numel(plan.entries[m].blocks[me]) for m in batch.owned_by(src)) for src in range(size)
    ]
    returned = all_to_all_chunks(
        back, from_owner, group=group, dtype=results.dtype, device=results.device, stats=stats
    )
    out: dict[int, Tensor] = {}
    for src in range(size):
        offset = 0
        for member in batch.owned_by(src):
            block = plan.entries[member].blocks[me]
            out[member] = returned[src][offset : offset + block_numel(block)].view(block_shape(block))
            offset += block_numel(block)
    return out


def run_plan(
    plan: Plan,
    me: int,
    local: Sequence[Tensor],
    orthogonalize: Orthogonalize,
    *,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> list[Tensor]:
    """Orthogonalize every matrix of ``plan``; ``local[i]`` is my block of entry ``i`` (NS dtype).

    ``group`` is the exchange process group, or None when the group is this rank alone.
    Returns my block of every orthogonalized matrix, in entry order.
    """
    by_index = dict(enumerate(local))
    out: dict[int, Tensor] = {}
    for batch in plan.batches:
        fulls = _to_owners(plan, batch, me, by_index, group, stats)
        results = orthogonalize(fulls) if fulls.size(0) else fulls
        out.update(_to_blocks(plan, batch, me, results, group, stats))
    return [out[i] for i in range(len(local))]
