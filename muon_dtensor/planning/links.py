"""Bytes per rank and link of one exchange round, read from the plan: the all-to-all to the owners
and the one back. Pure arithmetic for ``costmodel``; ``nodes[r]`` is group rank r's node."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..sharding.plan.blocks import block_numels
from ..sharding.plan.build import EVERYONE, MatrixEntry, Plan
from .hardware import Hardware

__all__ = ["Links", "back_links", "block_numels", "pipeline_seconds", "to_owner_links"]


@dataclass
class Links:
    """Bytes per rank in one all-to-all: sent and received, inside the node and across nodes."""

    send_intra: list[float]
    send_inter: list[float]
    recv_intra: list[float]
    recv_inter: list[float]

    @classmethod
    def empty(cls, n: int) -> Links:
        return cls([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)

    def add(self, src: int, dst: int, nbytes: float, nodes: Sequence[int]) -> None:
        if nodes[src] == nodes[dst]:
            self.send_intra[src] += nbytes
            self.recv_intra[dst] += nbytes
        else:
            self.send_inter[src] += nbytes
            self.recv_inter[dst] += nbytes

    def sent(self, rank: int) -> float:
        return self.send_intra[rank] + self.send_inter[rank]

    def seconds(self, hw: Hardware) -> float:
        """The busiest rank's busiest link; each link carries one send and one receive at once."""
        worst = 0.0
        for si, se, ri, re in zip(
            self.send_intra, self.send_inter, self.recv_intra, self.recv_inter, strict=True
        ):
            worst = max(worst, max(si, ri) / hw.intra_node_bandwidth, max(se, re) / hw.inter_node_bandwidth)
        return hw.collective_latency + worst


def _gather(links: Links, entry: MatrixEntry, size: Sequence[float], nodes: Sequence[int]) -> None:
    """Every rank reads every block of its replica: sums per (replica, node) keep this O(ranks)."""
    n = len(size)
    replica = entry.replica_of or (0,) * n
    node_sum: dict[tuple[int, int], float] = {}
    node_count: dict[tuple[int, int], int] = {}
    total: dict[int, float] = {}
    count: dict[int, int] = {}
    for r in range(n):
        key = (replica[r], nodes[r])
        node_sum[key] = node_sum.get(key, 0.0) + size[r]
        node_count[key] = node_count.get(key, 0) + 1
        total[replica[r]] = total.get(replica[r], 0.0) + size[r]
        count[replica[r]] = count.get(replica[r], 0) + 1
    for r in range(n):
        key = (replica[r], nodes[r])
        links.recv_intra[r] += node_sum[key] - size[r]
        links.recv_inter[r] += total[replica[r]] - node_sum[key]
        links.send_intra[r] += size[r] * (node_count[key] - 1)
        links.send_inter[r] += size[r] * (count[replica[r]] - node_count[key])


def to_owner_links(
    plan: Plan, members: Sequence[int], owners: Sequence[int], itemsize: int, nodes: Sequence[int]
) -> Links:
    """Traffic of one round's all-to-all to the owners (gather mode: to everyone). A replicated
    matrix stays put (its owner holds it); with replicas, an owner reads its own replica's blocks."""
    links = Links.empty(plan.group_size)
    for member, owner in zip(members, owners, strict=True):
        entry = plan.entries[member]
        if entry.replicated:
            continue
        size = [numel * itemsize for numel in block_numels(entry.blocks)]
        if owner == EVERYONE:
            _gather(links, entry, size, nodes)
            continue
        sources = [r for r in range(plan.group_size) if r != owner and entry.feeds(r, owner)]
        _one_end(links, owner, sources, size, nodes, to_owner=True)
    return links


def _one_end(
    links: Links, end: int, others: Sequence[int], size: Sequence[float], nodes: Sequence[int], to_owner: bool
) -> None:
    """``links.add`` between ``end`` and each of ``others`` (``size[r]`` bytes; to ``end``, or from
    it), without a call per pair: a 1,024-rank prediction adds a few million."""
    home = nodes[end]
    sends_a, sends_e = (
        (links.send_intra, links.send_inter) if to_owner else (links.recv_intra, links.recv_inter)
    )
    near = far = 0.0
    for r in others:
        if nodes[r] == home:
            sends_a[r] += size[r]
            near += size[r]
        else:
            sends_e[r] += size[r]
            far += size[r]
    if to_owner:
        links.recv_intra[end] += near
        links.recv_inter[end] += far
    else:
        links.send_intra[end] += near
        links.send_inter[end] += far


def back_links(
    plan: Plan, members: Sequence[int], owners: Sequence[int], itemsize: int, nodes: Sequence[int]
) -> Links:
    """Traffic of one round's all-to-all back: each owner sends every other rank its block."""
    links = Links.empty(plan.group_size)
    for member, owner in zip(members, owners, strict=True):
        if owner == EVERYONE:
            continue
        size = [numel * itemsize for numel in block_numels(plan.entries[member].blocks)]
        _one_end(links, owner, [r for r in range(plan.group_size) if r != owner], size, nodes, to_owner=False)
    return links


def pipeline_seconds(compute: Sequence[float], to_owner: Sequence[float], back: Sequence[float]) -> float:
    """Device seconds of ``exchange.run_plan``'s rounds. Collectives run one at a time in issue order
    (in 0, in 1, out 0, in 2, out 1, ...); round k's compute waits for in k, out k for round k."""
    comm = to_owner[0]
    done_in = [comm] + [0.0] * (len(compute) - 1)
    busy = 0.0
    for k, seconds in enumerate(compute):
        if k + 1 < len(compute):
            comm += to_owner[k + 1]
            done_in[k + 1] = comm
        busy = max(busy, done_in[k]) + seconds
        comm = max(comm, busy) + back[k]
    return max(comm, busy)
