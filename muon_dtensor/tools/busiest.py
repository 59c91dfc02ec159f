"""The rank with the most modelled work in a layout, from the plans alone (no process): its
Newton-Schulz flops (``Plan.loads``) and the bytes it sends (``Plan.bytes_sent``), priced on one
machine, so ``plan --rehearse --busiest`` rehearses the rank that sets the step's pace."""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.hardware import Hardware
from .launch_check import Laid

__all__ = ["Busiest", "busiest"]

# Ranks priced exactly (bytes sent); the others are ranked by flops and owned elements, which set
# the bytes an owner sends, so the busiest is among the first few of either order.
CANDIDATES = 4


@dataclass(frozen=True)
class Busiest:
    """The chosen ``rank`` with its Newton-Schulz flops and bytes sent per step, the mean flops over
    ranks, and rank 0's figures (the default of ``--rank``), for the reason printed."""

    rank: int
    flops: int
    sent: int
    mean_flops: float
    rank0_flops: int
    rank0_sent: int

    def why(self) -> str:
        return (
            f"rank {self.rank} has the most modelled work: {self.flops / 1e9:,.1f} GFLOP of Newton-Schulz "
            f"per step (mean over ranks {self.mean_flops / 1e9:,.1f}) and sends {self.sent / 2**20:,.1f} MiB "
            f"(rank 0: {self.rank0_flops / 1e9:,.1f} GFLOP, {self.rank0_sent / 2**20:,.1f} MiB)"
        )


def _owned(laid: Laid) -> dict[tuple[int, ...], list[int]]:
    """Per exchange group, the elements of the matrices each group rank owns."""
    out = {}
    for axes, plan in laid.plans.items():
        owned = [0] * plan.group_size
        for rnd in plan.rounds:
            for member, owner in zip(rnd.members, rnd.owners):
                if 0 <= owner < plan.group_size:
                    owned[owner] += _numel(plan.entries[member].shape)
        out[axes] = owned
    return out


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def busiest(laid: Laid, gpus: int, hw: Hardware, ns_steps: int, itemsize: int = 2) -> Busiest:
    """The rank whose Newton-Schulz (``ns_steps`` iterations at ``hw.matmul_flops``) and bytes sent
    (``itemsize`` per element, over ``hw.inter_node_bandwidth``) take longest, of ``laid`` on ``gpus``."""
    owned = _owned(laid)
    flops = [0] * gpus
    weight = [0] * gpus
    for axes, plan in laid.plans.items():
        for rank in range(gpus):
            g = laid.group_rank(rank, axes)
            flops[rank] += plan.loads[g] * ns_steps
            weight[rank] += owned[axes][g]

    def sent(rank: int) -> int:
        return sum(
            plan.bytes_sent(laid.group_rank(rank, axes), itemsize) for axes, plan in laid.plans.items()
        )

    order = sorted(range(gpus), key=lambda r: -flops[r])[:CANDIDATES]
    order += sorted(range(gpus), key=lambda r: -weight[r])[:CANDIDATES]
    priced = {r: sent(r) for r in dict.fromkeys([*order, 0])}
    rank = max(priced, key=lambda r: (flops[r] / hw.matmul_flops + priced[r] / hw.inter_node_bandwidth, -r))
    return Busiest(rank, flops[rank], priced[rank], sum(flops) / gpus, flops[0], priced[0])
