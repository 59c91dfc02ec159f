"""Split Newton-Schulz in the step: a round's split matrices orthogonalized by their gangs.

``split_compute`` is the exchange's step 3 for the parts of split matrices; ``GangComm`` gives
``split_ns.split_newton_schulz`` its two collectives (``split_ns.GangOps``) over the exchange
group, so the math stays free of process groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ...numerics.newton_schulz import NSConfig
from ...numerics.split_ns import part_sizes, split_newton_schulz
from ..plan.gangs import SplitRoute
from .comm import CommStats, start_all_to_all

__all__ = ["GangComm", "split_compute"]


def split_compute(
    route: SplitRoute,
    parts: dict[int, Tensor],
    *,
    config: NSConfig,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> dict[int, Tensor]:
    """Step 3 for a round's split matrices: this rank's parts (tall matrices' row blocks transposed
    into the wide form's column blocks) orthogonalized with their gangs, back in the parts' shape."""
    assert group is not None, "a split matrix spans ranks of a group"
    gangs = [(route.gangs[g], j) for g, j in route.mine]
    blocks = [parts[g.parts[j]].mT if g.tall else parts[g.parts[j]] for g, j in gangs]
    outs = split_newton_schulz(blocks, config, GangComm(route, group, config.dtype, stats))
    if stats is not None:
        stats.orthogonalized += sum(j == 0 for _, j in gangs)  # each split matrix once
    return {g.parts[j]: out.mT if g.tall else out for (g, j), out in zip(gangs, outs)}


class GangComm:
    """``split_ns.GangOps`` over an exchange group: each gang's row blocks move in an all-to-all of
    the whole group that carries bytes only between the gang's ranks. Every rank of the group calls
    every method in the same order, with nothing to send when it computes no part (``route.mine``
    empty); ``dtype`` types those empty buffers. Sums run in gang order, as ``LocalGang``'s do."""

    def __init__(
        self, route: SplitRoute, group: dist.ProcessGroup, dtype: torch.dtype, stats: CommStats | None
    ) -> None:
        self.gangs = [route.gangs[g] for g, _ in route.mine]
        self.slots = [j for _, j in route.mine]
        self.group, self.dtype, self.stats = group, dtype, stats

    def _exchange(self, sends: list[list[Tensor]], recv: list[int], like: Sequence[Tensor]) -> list[Tensor]:
        sample = like[0] if like else torch.empty(0, dtype=self.dtype)
        finish = start_all_to_all(
            sends, recv, group=self.group, dtype=sample.dtype, device=sample.device, stats=self.stats
        )
        return finish()

    def reduce_rows(self, parts: Sequence[Tensor]) -> list[Tensor]:
        size = dist.get_world_size(self.group)
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        recv = [0] * size
        chunks = [p.tensor_split(len(g.ranks), dim=-2) for p, g in zip(parts, self.gangs)]
        for gang, j, pieces in zip(self.gangs, self.slots, chunks):
            for rank, piece in zip(gang.ranks, pieces):
                sends[rank].append(piece)
                recv[rank] += pieces[j].numel()
        got = self._exchange(sends, recv, parts)
        offsets = [0] * size
        out = []
        for gang, j, pieces in zip(self.gangs, self.slots, chunks):
            total: Tensor | None = None
            for rank in gang.ranks:
                n = pieces[j].numel()
                piece = got[rank][offsets[rank] : offsets[rank] + n].view(pieces[j].shape)
                offsets[rank] += n
                total = piece.clone() if total is None else total.add_(piece)
            assert total is not None
            out.append(total)
        return out

    def gather_rows(self, rows: Sequence[Tensor], totals: Sequence[int]) -> list[Tensor]:
        size = dist.get_world_size(self.group)
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        recv = [0] * size
        shapes = []
        for gang, row, total in zip(self.gangs, rows, totals):
            lead, cols = row.shape[:-2], row.shape[-1]
            shapes.append([(*lead, n, cols) for n in part_sizes(total, len(gang.ranks))])
            for rank, shape in zip(gang.ranks, shapes[-1]):
                sends[rank].append(row)
                recv[rank] += math.prod(shape)
        got = self._exchange(sends, recv, rows)
        offsets = [0] * size
        out = []
        for gang, pieces in zip(self.gangs, shapes):
            blocks = []
            for rank, shape in zip(gang.ranks, pieces):
                n = math.prod(shape)
                blocks.append(got[rank][offsets[rank] : offsets[rank] + n].view(shape))
                offsets[rank] += n
            out.append(torch.cat(blocks, dim=-2))
        return out
