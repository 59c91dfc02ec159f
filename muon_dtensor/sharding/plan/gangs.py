"""Split matrices in the plan: which ranks share one matrix's Newton-Schulz ("a gang"), pure data.

A matrix split over k ranks enters the plan as k part entries (``views.split_view``: column blocks
of its wide form). Each part has one owner, so the blocks travel to the owners and back as any
matrix's do; the k owners are k consecutive group ranks aligned to k (one node when k divides the
node size), and they run the iteration together (``split_ns.py``) with collectives over the
exchange group that carry bytes only between a gang's ranks (``split_exchange.GangComm``). Every rank of the
group takes part in every such collective of a round (with nothing to send when it is in no gang),
so each rank's route names every gang of the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...numerics.split_ns import split_flops

__all__ = ["Gang", "SplitRoute", "gang_cost", "gang_start", "split_route"]


@dataclass(frozen=True)
class Gang:
    """One split matrix: its plan entries (the parts, in order), the group rank computing each, and
    the whole matrix's shape."""

    parts: tuple[int, ...]
    ranks: tuple[int, ...]
    shape: tuple[int, int]

    @property
    def tall(self) -> bool:
        """Parts are row blocks of a tall matrix (transposed to run), else column blocks."""
        return self.shape[0] > self.shape[1]


@dataclass(frozen=True)
class SplitRoute:
    """A round's gangs as one rank sees them: every gang of the round, and for each part this rank
    computes, (index into ``gangs``, its position in the gang), in gang order."""

    gangs: tuple[Gang, ...]
    mine: tuple[tuple[int, int], ...]


def gang_cost(shape: Sequence[int], k: int) -> int:
    """Newton-Schulz flops per iteration on each rank of a gang of ``k`` (the plan's load unit)."""
    return split_flops(shape, k)


def gang_start(loads: Sequence[int], k: int) -> int:
    """The first rank of the aligned group of ``k`` ranks whose busiest rank is least loaded."""
    return min(range(0, len(loads) - k + 1, k), key=lambda s: (max(loads[s : s + k]), s))


def split_route(gangs: Sequence[Gang], members: Sequence[int], me: int) -> SplitRoute | None:
    """Rank ``me``'s view of the gangs whose parts are among a round's ``members``; None if none."""
    inside = set(members)
    mine_gangs = tuple(g for g in gangs if g.parts[0] in inside)
    if not mine_gangs:
        return None
    mine = tuple((i, g.ranks.index(me)) for i, g in enumerate(mine_gangs) if me in g.ranks)
    return SplitRoute(mine_gangs, mine)
