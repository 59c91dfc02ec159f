"""Routes are pure data derived from a plan and a rank: checked for every rank of a group, with no
process, that what each rank sends is what its peer expects, and that each owner assembles every
element of its matrices exactly once and gets back exactly its own blocks."""

from __future__ import annotations

import math

import pytest

from muon_dtensor.sharding.plan.blocks import AxisShard, Block, block_numel, full_block, shard_blocks
from muon_dtensor.sharding.plan.build import EVERYONE, MatrixEntry, Plan, build_plan
from muon_dtensor.sharding.plan.routes import RoundRoute, build_routes

SHAPES = [(37, 24), (24, 37), (3, 16), (1, 8), (64, 64), (64, 64), (16, 96)]


def _entries(size: int) -> list[MatrixEntry]:
    """Row-sharded (uneven, some ranks empty), column-strided (FSDP over TP), one replicated matrix
    and one expert held whole by the last rank."""
    out = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, size)])) for s in SHAPES]
    strided = [AxisShard(0, 1, size, split_factor=2)]
    out.append(MatrixEntry((20, 30), shard_blocks((20, 30), strided)))
    out.append(MatrixEntry((12, 12), (full_block((12, 12)),) * size, replicated=size > 1))
    empty: Block = (((0, 0),), ((0, 0),))
    out.append(MatrixEntry((9, 5), (empty,) * (size - 1) + (full_block((9, 5)),)))
    return out


def _cells(block: Block) -> list[tuple[int, int]]:
    return [(r, c) for a, b in block[0] for r in range(a, b) for c0, c1 in block[1] for c in range(c0, c1)]


def _owners(plan: Plan) -> dict[int, int]:
    return {m: o for rnd in plan.rounds for m, o in zip(rnd.members, rnd.owners)}


def _check_inbound(plan: Plan, routes: list[tuple[RoundRoute, ...]], k: int) -> None:
    size, owners = plan.group_size, _owners(plan)
    for d in range(size):
        into = routes[d][k].inbound
        for s in range(size):
            sent = routes[s][k].inbound.sends[d] if routes[s][k].inbound.collective else ()
            assert sum(block_numel(plan.entries[m].blocks[s]) for m in sent) == into.recv_numels[s]
            assert [m for m, src, _, _ in into.received if src == s] == list(sent)
            offsets = [off for _, src, off, _ in into.received if src == s]
            sizes = [block_numel(plan.entries[m].blocks[s]) for m in sent]
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
        for shape, members in into.stacks:
            for m in members:
                assert owners[m] in (d, EVERYONE) and plan.entries[m].shape == shape
                if into.direct:
                    continue
                cells = [] if m not in into.copies else _cells(full_block(shape))
                cells += [c for mm, b in into.own if mm == m for c in _cells(b)]
                cells += [c for mm, _, _, b in into.received if mm == m for c in _cells(b)]
                assert sorted(cells) == _cells(full_block(shape)), (d, m)


def _check_outbound(plan: Plan, routes: list[tuple[RoundRoute, ...]], k: int) -> None:
    size = plan.group_size
    for d in range(size):
        out = routes[d][k].outbound
        got = {m: shape for m, _, _, shape in out.received} | dict(out.empty)
        got |= {m: tuple(sum(b - a for a, b in dim) for dim in block) for m, block in out.own}
        assert sorted(got) == sorted(routes[d][k].members)
        for m, shape in got.items():
            mine = plan.entries[m].blocks[d]
            assert math.prod(shape) == block_numel(mine)
        assert all(plan.entries[m].blocks[d] == block for m, block in out.own)
        for s in range(size) if out.collective else ():
            sent = routes[s][k].outbound.sends[d]
            assert sum(block_numel(b) for _, b in sent) == out.recv_numels[s]
            assert all(b == plan.entries[m].blocks[d] for m, b in sent)


@pytest.mark.parametrize("mode", ["owner", "gather"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("max_round_bytes", [None, 3000])
def test_routes_agree_between_ranks_and_cover_every_matrix(
    mode: str, size: int, max_round_bytes: int | None
) -> None:
    plan = build_plan(_entries(size), size, mode, max_round_bytes=max_round_bytes)
    routes = [build_routes(plan, me) for me in range(size)]
    assert len(plan.rounds) > (1 if max_round_bytes and size < 8 else 0)
    for k in range(len(plan.rounds)):
        _check_inbound(plan, routes, k)
        _check_outbound(plan, routes, k)


def test_routes_of_a_1024_rank_plan_build_without_a_process() -> None:
    shapes = [(4096, 4096), (1024, 4096), (14336, 4096)] * 8
    entries = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, 1024)])) for s in shapes]
    plan = build_plan(entries, 1024)
    routes = build_routes(plan, 5)
    inbound = routes[0].inbound
    # rank 5 owns at most one matrix here and receives its rows from the 1,023 others
    owned = [m for _, ms in inbound.stacks for m in ms]
    assert len(owned) <= 1
    assert sum(inbound.recv_numels) == sum(
        math.prod(shapes[m]) - block_numel(entries[m].blocks[5]) for m in owned
    )
