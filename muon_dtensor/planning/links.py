"""Bytes per rank and link of one exchange round, read from the plan: the all-to-all to the owners
and the one back. Pure arithmetic for ``costmodel``; ``nodes[r]`` is group rank r's node."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..sharding.plan.blocks import block_numels
from ..sharding.plan.build import EVERYONE, MatrixEntry, Plan
from .hardware import Hardware

__all__ = [
    "Links",
    "back_links",
    "block_numels",
    "local_elements",
    "node_pattern",
    "owned",
    "pipeline_seconds",
    "to_owner_links",
]


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
    # (blocks tuple, replica_of tuple) -> (sizes in bytes, replica_of, owners): one O(ranks) pass
    # per layout and replica, where a pass per matrix made an 8,192-rank HSDP price take seconds
    alike: dict[tuple[int, int], tuple[list[int], tuple[int, ...] | None, list[int]]] = {}
    for member, owner in zip(members, owners, strict=True):
        entry = plan.entries[member]
        if entry.replicated:
            continue
        key = (id(entry.blocks), id(entry.replica_of))
        if owner == EVERYONE:
            _gather(links, entry, [numel * itemsize for numel in block_numels(entry.blocks)], nodes)
            continue
        if key not in alike:
            alike[key] = ([numel * itemsize for numel in block_numels(entry.blocks)], entry.replica_of, [])
        alike[key][2].append(owner)
    for sizes, replica_of, ends in alike.values():
        for replica, mine in _by_replica(replica_of, ends).items():
            # an owner reads the blocks of its own replica only
            own = (
                sizes if replica_of is None else [s if c == replica else 0 for s, c in zip(sizes, replica_of)]
            )
            owned(links, own, mine, nodes, to_owner=True)
    return links


def _by_replica(replica_of: Sequence[int] | None, ends: Sequence[int]) -> dict[int | None, list[int]]:
    """``ends`` by the replica each belongs to (one key, None, without replicas)."""
    out: dict[int | None, list[int]] = {}
    for e in ends:
        out.setdefault(None if replica_of is None else replica_of[e], []).append(e)
    return out


def owned(
    links: Links, size: Sequence[float], ends: Sequence[int], nodes: Sequence[int], to_owner: bool
) -> None:
    """``links.add`` between each rank r and each of ``ends`` but itself, ``size[r]`` bytes each
    (to the end, or from it), counted per node: O(ranks + ends) per call, where a call per pair
    made a 1,024-rank prediction add millions."""
    per_node: dict[int, float] = {}
    for node, nbytes in zip(nodes, size):
        per_node[node] = per_node.get(node, 0.0) + nbytes
    on_node: dict[int, int] = {}
    mine: dict[int, int] = {}
    for e in ends:
        on_node[nodes[e]] = on_node.get(nodes[e], 0) + 1
        mine[e] = mine.get(e, 0) + 1
    here = [on_node.get(node, 0) for node in nodes[: len(size)]]
    k = len(ends)
    near, far = (links.send_intra, links.send_inter) if to_owner else (links.recv_intra, links.recv_inter)
    near[:] = [a + b * (h - mine.get(r, 0)) if b else a for r, (a, b, h) in enumerate(zip(near, size, here))]
    far[:] = [a + b * (k - h) if b else a for a, b, h in zip(far, size, here)]
    near, far = (links.recv_intra, links.recv_inter) if to_owner else (links.send_intra, links.send_inter)
    total = sum(size)
    for e in ends:
        near[e] += per_node[nodes[e]] - size[e]
        far[e] += total - per_node[nodes[e]]


def back_links(
    plan: Plan, members: Sequence[int], owners: Sequence[int], itemsize: int, nodes: Sequence[int]
) -> Links:
    """Traffic of one round's all-to-all back: each owner sends every other rank its block."""
    links = Links.empty(plan.group_size)
    alike: dict[int, tuple[list[int], list[int]]] = {}
    for member, owner in zip(members, owners, strict=True):
        if owner != EVERYONE:
            blocks = plan.entries[member].blocks
            if id(blocks) not in alike:
                alike[id(blocks)] = ([numel * itemsize for numel in block_numels(blocks)], [])
            alike[id(blocks)][1].append(owner)
    for size, ends in alike.values():
        owned(links, size, ends, nodes, to_owner=False)
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


def local_elements(plan: Plan) -> list[int]:
    """Each rank's elements of the plan's matrices: one O(ranks) pass per layout, not per matrix."""
    alike: dict[int, tuple[tuple[int, ...], int]] = {}
    for e in plan.entries:
        numels, count = alike[id(e.blocks)] if id(e.blocks) in alike else (block_numels(e.blocks), 0)
        alike[id(e.blocks)] = (numels, count + 1)
    total = [0] * plan.group_size
    for numels, count in alike.values():
        total = [t + count * x for t, x in zip(total, numels)]
    return total


def node_pattern(nodes: Sequence[int]) -> tuple[int, ...]:
    """Nodes renumbered in order of first appearance: the links price only which ranks share a node."""
    seen: dict[int, int] = {}
    return tuple(seen.setdefault(node, len(seen)) for node in nodes)
