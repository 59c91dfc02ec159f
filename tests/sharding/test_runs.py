"""Strided runs (``sharding/plan/runs.py``): the copies between matrices and exchange buffers, merged.

Pure, no process: the runs and loose blocks of every route move exactly the elements the
block-by-block copies move (checked on random buffers, every rank of several layouts), and even
row sharding collapses an owner's copies to a few runs however many ranks there are.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from muon_dtensor.planning.plans import hsdp_plan, sharded_plan
from muon_dtensor.sharding.plan.blocks import AxisShard, Block, block_numel, shard_blocks
from muon_dtensor.sharding.plan.build import MatrixEntry, build_plan
from muon_dtensor.sharding.plan.routes import Inbound, Outbound, RoundRoute, build_routes
from muon_dtensor.sharding.plan.runs import Run, merge_members, merge_runs, owner_copies, segments
from muon_dtensor.sharding.runtime.exchange import _assemble, _cut, pack_results, unpack_received

ROWS: Block = (((0, 2),), ((0, 3),))


def _rows(start: int, stop: int, cols: int = 3) -> Block:
    return (((start, stop),), ((0, cols),))


def test_equal_row_blocks_at_a_fixed_stride_are_one_run() -> None:
    items = [(0, 10 * i, _rows(2 * i, 2 * i + 2)) for i in range(4)]
    assert merge_runs(items, {0: 3}) == ((Run(0, 0, 2, 4, 0, 10),), ())


def test_what_breaks_a_run() -> None:
    cols = {0: 3, 1: 3}
    # a gap in rows, another height, another stride: three runs
    items = [(0, 0, _rows(0, 2)), (0, 10, _rows(4, 6)), (0, 20, _rows(6, 7)), (0, 30, _rows(7, 8))]
    assert merge_runs(items, cols)[0] == (
        Run(0, 0, 2, 1, 0, 6),
        Run(0, 4, 2, 1, 10, 6),
        Run(0, 6, 1, 2, 20, 10),
    )
    # partial width and two rectangles stay loose, an empty block needs no copy; members interleave
    loose = [(0, 0, (((0, 2),), ((0, 2),))), (0, 4, (((0, 1), (3, 4)), ((0, 3),))), (1, 10, _rows(0, 0))]
    runs, rest = merge_runs([*loose, (1, 10, _rows(0, 1)), (0, 20, _rows(0, 1)), (1, 30, _rows(1, 2))], cols)
    assert rest == (0, 1)
    assert runs == (Run(1, 0, 1, 2, 10, 20), Run(0, 0, 1, 1, 20, 3))


def _layouts(n: int) -> list[list[MatrixEntry]]:
    """Even rows, uneven rows, columns, FSDP x TP grids and strided shards, several per round."""
    shapes = [(8 * n, 24)] * 2 * n + [(5 * n + 3, 16), (12, 4 * n), (2 * n, 6)]
    even = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, n)])) for s in shapes]
    cols = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 1, n)])) for s in shapes]
    grid = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, 2), AxisShard(1, 1, n // 2)])) for s in shapes]
    strided = [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, n, split_factor=2)])) for s in shapes]
    return [even, cols, grid, strided]


def _stacks(route: Inbound, shapes: dict[int, tuple[int, int]], together: bool = True) -> dict[int, Tensor]:
    """Full matrices of the route's stacks, each stack one tensor (``together``) as the exchange
    assembles them, else separate (and every other one strided), as unbatched results are."""
    out: dict[int, Tensor] = {}
    for shape, members in route.stacks:
        if together:
            out |= dict(zip(members, torch.zeros((len(members), *shape)).unbind(0)))
        else:
            out |= {
                m: torch.zeros(shape) if i % 2 else torch.zeros(shape).mT.contiguous().mT
                for i, m in enumerate(members)
            }
    return out


def _assembled_by_runs(
    route: Inbound, buffer: Tensor, shapes: dict[int, tuple[int, int]]
) -> dict[int, Tensor]:
    out = _stacks(route, shapes)
    out |= {m: torch.zeros(shapes[m]) for m, *_ in route.received if m not in out}
    unpack_received(route, buffer, out)  # the step's own copies, against the block-by-block reference
    return out


def _assembled_by_blocks(
    route: Inbound, buffer: Tensor, shapes: dict[int, tuple[int, int]]
) -> dict[int, Tensor]:
    out = {m: torch.zeros(shapes[m]) for m, *_ in route.received}
    segments = buffer.split(list(route.recv_numels))
    for m, src, offset, block in route.received:
        _assemble(out[m], block, segments[src][offset : offset + block_numel(block)])
    return out


def _packed_by_blocks(route: Outbound, results: dict[int, Tensor]) -> Tensor:
    pieces = [_cut(results[m], block).reshape(-1) for per_dest in route.sends for m, block in per_dest]
    return torch.cat(pieces) if pieces else torch.empty(0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_runs_move_what_the_block_copies_move(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    merged = loose = members = 0
    for entries in _layouts(n):
        shapes = {i: e.shape for i, e in enumerate(entries)}
        for rounds in (None, 200):
            plan = build_plan(entries, n, max_round_bytes=rounds)
            for me in range(n):
                for route in build_routes(plan, me):
                    merged += sum(r.count > 1 for r in route.inbound.runs + route.outbound.send_runs)
                    members += sum(bool(r.more) for r in route.inbound.runs + route.outbound.send_runs)
                    loose += len(route.inbound.loose) + len(route.outbound.send_loose)
                    buffer = torch.randn(sum(route.inbound.recv_numels), generator=gen)
                    by_runs = _assembled_by_runs(route.inbound, buffer, shapes)
                    assert by_runs.keys() == _assembled_by_blocks(route.inbound, buffer, shapes).keys()
                    for m, full in _assembled_by_blocks(route.inbound, buffer, shapes).items():
                        assert torch.equal(by_runs[m], full)
                    for together in (True, False):  # batched results, or one tensor each
                        results = {m: torch.randn(shapes[m], generator=gen) for m in shapes}
                        for m, r in _stacks(route.inbound, shapes, together).items():
                            results[m] = r.copy_(torch.randn(shapes[m], generator=gen))
                        if route.outbound.collective:
                            nan = torch.full((sum(route.outbound.send_numels),), float("nan"))
                            packed = pack_results(route.outbound, results, nan)  # the step's own copies
                            assert torch.equal(packed, _packed_by_blocks(route.outbound, results))
    assert loose and (merged or n == 2), "the layouts exercise both paths (2 ranks: one source each)"
    assert members, "same-shape matrices of a stack share a run"


def test_only_a_stacks_neighbours_at_one_step_share_a_run() -> None:
    runs = [Run(m, 0, 2, 1, 6 * i, 6) for i, m in enumerate([3, 4, 5, 7])]
    # 3, 4, 5 are neighbours in one stack, 7 is not 5's successor
    assert merge_members(runs, {3: 4, 4: 5, 5: 9}) == (Run(3, 0, 2, 1, 0, 6, (4, 5), 6), runs[3])
    # another height or another step breaks the run
    odd = [Run(3, 0, 2, 1, 0, 6), Run(4, 0, 1, 1, 6, 3), Run(5, 0, 2, 1, 20, 6)]
    assert merge_members(odd, {3: 4, 4: 5}) == tuple(odd)
    assert Run(3, 0, 2, 1, 0, 6, (4, 5), 6).single(2) == Run(5, 0, 2, 1, 12, 6)


def test_segments_cat_same_width_pieces_together() -> None:
    assert segments([16, 16, 16, 48, 48]) == ((0, 3, 16), (3, 5, 48))
    assert segments([16, 48, 16, None, 8, 8]) == ((0, 4, None), (4, 6, 8))
    assert segments([]) == ()


def test_even_rows_take_a_few_copies_at_1024_ranks() -> None:
    """One 14336 x 4096 matrix on 1,024 row shards: its owner assembles it in at most 2 runs (the
    sources before and after itself) and packs it back in as many, instead of 1,023 copies each way."""
    n, shape = 1024, (14336, 4096)
    plan = build_plan([MatrixEntry(shape, shard_blocks(shape, [AxisShard(0, 0, n)]))], n)
    owner = plan.rounds[0].owners[0]
    route = build_routes(plan, owner)[0]
    assert len(route.inbound.runs) == (1 if owner in (0, n - 1) else 2) and not route.inbound.loose
    assert len(route.outbound.send_runs) == len(route.inbound.runs) and not route.outbound.send_loose
    assert sum(r.count for r in route.inbound.runs) == n - 1


def _route_copies(route: RoundRoute, member: int) -> int:
    """Copies an owner's route makes for one member: runs and loose blocks both ways, and its own."""
    into, out = route.inbound, route.outbound
    runs = sum(r.member == member for r in into.runs + out.send_runs)
    loose = sum(m == member for m, _, _ in into.loose + out.send_loose)
    return runs + loose + sum(m == member for m, _ in into.own)


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_uneven", "hsdp"])
def test_the_cost_models_copies_bound_the_routes(layout: str) -> None:
    """``owner_copies`` (the cost model's host ops per owned matrix) bounds what the routes do,
    with equality for an owner amid its sources, on even and uneven FSDP and on HSDP with owners
    over the mesh; far below the block count (2 n - 1) it replaces."""
    shapes = [(64, 48), (64, 48), (32, 16), (16, 40)] if layout != "fsdp_uneven" else [(61, 48), (30, 16)]
    plan = hsdp_plan(shapes, 4, 3) if layout == "hsdp" else sharded_plan(shapes, 16)
    tight = 0
    for me in range(plan.group_size):
        for rnd, route in zip(plan.rounds, build_routes(plan, me)):
            for m in rnd.owned_by(me):
                e = plan.entries[m]
                bound = owner_copies(e.blocks, e.shape[-1], len(set(e.replica_of)) if e.replica_of else 1)
                assert _route_copies(route, m) <= bound < 2 * plan.group_size - 1
                tight += _route_copies(route, m) == bound
    assert tight
