"""Run a plan: blocks to their owners, Newton-Schulz once per matrix, results back to every block.

For one round of the plan, on group rank ``me``:
  1. send my block of every matrix to its owner (gather mode: to every rank): one all-to-all;
  2. assemble each matrix I own from the blocks, in global index order, stacked by shape;
  3. orthogonalize my same-shape matrices together;
  4. send every rank its block of each result (gather mode: slice locally): one all-to-all.
Assembly and slicing follow the plan's blocks, so any layout that the layout module can describe is
exchanged the same way. A rank's blocks of the matrices it owns never enter a collective: they are
read from (and results sliced into) local tensors, which saves one copy each way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from torch import Tensor

from .comm import CommStats, start_all_to_all
from .blocks import Block, block_numel, block_shape
from .plan import EVERYONE, Plan, Round

__all__ = ["run_plan"]

Orthogonalize = Callable[[Sequence[Tensor]], Sequence[Tensor]]
# shape -> (members, their full matrices) on the rank that computes them
Stacks = dict[tuple[int, int], tuple[list[int], Sequence[Tensor]]]


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


def _by_shape(plan: Plan, members: Sequence[int]) -> dict[tuple[int, int], list[int]]:
    groups: dict[tuple[int, int], list[int]] = {}
    for m in members:
        groups.setdefault(plan.entries[m].shape, []).append(m)
    return groups


def _all_local(plan: Plan, rnd: Round) -> bool:
    """Every matrix of the round sits whole on its owner (expert parallel): no collective at all.
    Every rank reads this from the plan, so all skip together."""
    return plan.mode == "owner" and all(plan.entries[m].holder == o for m, o in zip(rnd.members, rnd.owners))


def _start_to_owners(
    plan: Plan,
    rnd: Round,
    me: int,
    local: dict[int, Tensor],
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
) -> Callable[[], Stacks]:
    """Steps 1-2: start moving blocks to owners; the returned function waits and assembles the
    full matrices this rank computes in ``rnd``, grouped by shape."""
    mine = rnd.owned_by(me)
    if group is None or _all_local(plan, rnd):
        return lambda: {s: (ms, [local[m] for m in ms]) for s, ms in _by_shape(plan, mine).items()}
    size = plan.group_size
    # Replicated matrices are already whole on their owner: nothing to send for them.
    replicated = {m for m in rnd.members if plan.entries[m].replicated}
    sends: list[list[Tensor]] = [[] for _ in range(size)]
    for member, owner in zip(rnd.members, rnd.owners):
        if member in replicated:
            continue
        for dest in range(size) if owner == EVERYONE else (owner,):
            if dest != me:  # my own blocks never enter the collective: one copy less each way
                sends[dest].append(local[member])
    incoming = [m for m in mine if m not in replicated]
    recv_numels = [
        0 if src == me else sum(block_numel(plan.entries[m].blocks[src]) for m in incoming)
        for src in range(size)
    ]
    sample = local[rnd.members[0]]
    if len(replicated) == len(rnd.members):  # every rank knows this from the plan: skip together
        receive = lambda: [sample.new_empty(0)] * size  # noqa: E731
    else:
        receive = start_all_to_all(
            sends, recv_numels, group=group, dtype=sample.dtype, device=sample.device, stats=stats
        )

    def finish() -> Stacks:
        received = receive()
        stacks: Stacks = {
            s: (ms, sample.new_empty((len(ms), *s)).unbind(0)) for s, ms in _by_shape(plan, mine).items()
        }
        where = {m: full for ms, fulls in stacks.values() for m, full in zip(ms, fulls)}
        for member in replicated.intersection(mine):
            where[member].copy_(local[member])
        for member in incoming:
            _assemble(where[member], plan.entries[member].blocks[me], local[member].reshape(-1))
        for src in range(size):
            offset = 0
            for member in incoming if src != me else ():
                block = plan.entries[member].blocks[src]
                _assemble(where[member], block, received[src][offset : offset + block_numel(block)])
                offset += block_numel(block)
        if stats is not None:
            stats.release(sum(recv_numels) * sample.element_size())
        return stacks

    return finish


def _start_to_blocks(
    plan: Plan,
    rnd: Round,
    me: int,
    results: dict[int, Tensor],
    group: dist.ProcessGroup | None,
    stats: CommStats | None,
    ref: Tensor,
) -> Callable[[], dict[int, Tensor]]:
    """Step 4: start sending results back; the returned function waits and returns my block of
    every matrix of ``rnd``."""
    mine = rnd.owned_by(me)
    if plan.mode == "gather" or group is None or _all_local(plan, rnd):
        # All-local rounds: what others own, I hold none of.
        out = {m: ref.new_empty(block_shape(plan.entries[m].blocks[me])) for m in rnd.members}
        out.update({m: _cut(results[m], plan.entries[m].blocks[me]) for m in mine})
        return lambda: out
    size = plan.group_size
    back = [
        [] if d == me else [_cut(results[m], plan.entries[m].blocks[d]) for m in mine] for d in range(size)
    ]
    from_owner = [
        0 if src == me else sum(block_numel(plan.entries[m].blocks[me]) for m in rnd.owned_by(src))
        for src in range(size)
    ]
    receive = start_all_to_all(back, from_owner, group=group, dtype=ref.dtype, device=ref.device, stats=stats)

    def finish() -> dict[int, Tensor]:
        returned = receive()
        out = {m: _cut(results[m], plan.entries[m].blocks[me]) for m in mine}
        for src in range(size):
            if src == me:
                continue
            offset = 0
            for member in rnd.owned_by(src):
                block = plan.entries[member].blocks[me]
                out[member] = returned[src][offset : offset + block_numel(block)].view(block_shape(block))
                offset += block_numel(block)
        if stats is not None:
            stats.release(sum(from_owner) * ref.element_size())
        return out

    return finish


def _compute(stacks: Stacks, orthogonalize: Orthogonalize, stats: CommStats | None) -> dict[int, Tensor]:
    results: dict[int, Tensor] = {}
    for members, fulls in stacks.values():
        results.update(zip(members, orthogonalize(fulls)))
        if stats is not None:
            stats.orthogonalized += len(members)
    return results


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

    ``group`` is the exchange process group, or None when the group is this rank alone. Rounds are
    pipelined: round k+1's blocks travel while round k is orthogonalized, and round k's results
    travel back while round k+1 is; so at most two rounds' buffers are alive at once. Every rank
    issues the collectives in the same order (in 0, in 1, out 0, in 2, out 1, ...).
    Returns my block of every orthogonalized matrix, in entry order.
    """
    by_index = dict(enumerate(local))
    out: dict[int, Tensor] = {}
    rounds = plan.rounds
    if not rounds:
        return []
    inbound = _start_to_owners(plan, rounds[0], me, by_index, group, stats)
    outbound: list[Callable[[], dict[int, Tensor]]] = []
    for k, rnd in enumerate(rounds):
        stacks = inbound()
        if k + 1 < len(rounds):
            inbound = _start_to_owners(plan, rounds[k + 1], me, by_index, group, stats)
        results = _compute(stacks, orthogonalize, stats)
        outbound.append(_start_to_blocks(plan, rnd, me, results, group, stats, ref=by_index[rnd.members[0]]))
        if len(outbound) > 1:
            out.update(outbound.pop(0)())
    for finish in outbound:
        out.update(finish())
    return [out[i] for i in range(len(local))]
