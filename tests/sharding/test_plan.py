"""The plan and the layout module are pure: checked here for up to 1,024 ranks with no process."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from muon_dtensor.numerics.newton_schulz import ns_flops
from muon_dtensor.sharding.plan.blocks import AxisShard, block_numel, block_shape, shard_blocks
from muon_dtensor.sharding.plan.build import EVERYONE, MatrixEntry, build_plan

# Llama-3-8B hidden matrices: 32 layers of q, o (4096x4096), k, v (1024x4096), gate, up (14336x4096),
# down (4096x14336) (Meta's params.json: dim 4096, n_kv_heads 8, ffn 14336).
LLAMA3_8B = [
    (4096, 4096),
    (1024, 4096),
    (1024, 4096),
    (4096, 4096),
    (14336, 4096),
    (14336, 4096),
    (4096, 14336),
]


def _entries(shapes: list[tuple[int, int]], ranks: int) -> list[MatrixEntry]:
    return [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, ranks)])) for s in shapes]


@pytest.mark.parametrize("ranks", [8, 64])
def test_llama3_8b_owner_plan_is_balanced(ranks: int) -> None:
    plan = build_plan(_entries(LLAMA3_8B * 32, ranks), ranks)
    assert plan.imbalance <= 1.06, plan.imbalance


def test_plan_for_1024_ranks_assigns_every_matrix_once() -> None:
    shapes = LLAMA3_8B * 32
    plan = build_plan(_entries(shapes, 1024), 1024)
    owners = {m: o for r in plan.rounds for m, o in zip(r.members, r.owners)}
    assert sorted(owners) == list(range(len(shapes)))
    assert all(0 <= o < 1024 for o in owners.values())
    # Fewer matrices than ranks: no rank may own two, so the busiest rank holds one biggest matrix.
    assert len(set(owners.values())) == len(shapes)
    assert max(plan.loads) == max(ns_flops(s) for s in shapes)
    # One round by default; rounds cover each matrix once.
    assert len(plan.rounds) == 1
    assert sorted(m for r in plan.rounds for m in r.members) == list(range(len(shapes)))


def test_plan_is_deterministic_and_loads_add_up() -> None:
    entries = _entries(LLAMA3_8B * 4, 8)
    a, b = build_plan(entries, 8), build_plan(list(entries), 8)
    assert a == b
    assert sum(a.loads) == sum(ns_flops(e.shape) for e in entries)


def test_gather_mode_gives_every_matrix_to_everyone() -> None:
    plan = build_plan(_entries([(64, 32)] * 3, 4), 4, mode="gather")
    assert all(o == EVERYONE for r in plan.rounds for o in r.owners)
    assert all(rnd.owned_by(r) == rnd.members for rnd in plan.rounds for r in range(4))


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bytes_sent_match_the_formulas(ranks: int) -> None:
    """Owner mode sends 2 S (N-1) / N^2 per rank on average, gather mode S (N-1) / N, S the bytes of
    all matrices: an owner gets the (N-1)/N of its 1/N of the matrices that other ranks hold and sends
    the results back (twice (N-1)/N^2 of S); gathering, a rank receives every piece it does not hold."""
    shapes = [(512, 512)] * 4 * ranks
    entries = _entries(shapes, ranks)
    total = sum(a * b for a, b in shapes) * 2
    owner = build_plan(entries, ranks)
    gather = build_plan(entries, ranks, mode="gather")
    mean_owner = sum(owner.bytes_sent(r, 2) for r in range(ranks)) / ranks
    assert mean_owner == pytest.approx(2 * total * (ranks - 1) / ranks**2, rel=0.05)
    assert gather.bytes_sent(0, 2) == pytest.approx(total * (ranks - 1) / ranks, rel=0.05)


def test_rounds_respect_the_byte_cap_and_mix_owners() -> None:
    shapes = LLAMA3_8B * 4
    cap = 2 * 14336 * 4096 * 3  # three of the largest matrices
    plan = build_plan(_entries(shapes, 8), 8, max_round_bytes=cap)
    assert len(plan.rounds) > 1
    for rnd in plan.rounds[:-1]:
        # every rank gets work in every round; only such a minimal round may exceed the cap
        assert len(rnd.members) >= 8
        assert len(rnd.members) == 8 or sum(2 * shapes[m][0] * shapes[m][1] for m in rnd.members) <= cap
        if len(rnd.members) > 1:
            assert len(set(rnd.owners)) > 1  # no round waits on a single rank
    assert sorted(m for r in plan.rounds for m in r.members) == list(range(len(shapes)))


def test_bad_plan_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="mode should be 'owner' or 'gather'"):
        build_plan([], 2, mode="bogus")
    with pytest.raises(ValueError, match="blocks for a group of 4"):
        build_plan(_entries([(8, 8)], 2), 4)


@pytest.mark.parametrize("shape", [(37, 24), (3, 16), (1, 8), (64, 64), (0, 5), (17, 1)])
@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (3,), (2, 2), (2, 4)])
def test_blocks_match_dtensor_local_shapes_and_offsets(shape: tuple, mesh_shape: tuple) -> None:
    """Our blocks against DTensor's own chunking, for every coordinate, with uneven and empty pieces."""
    for placements in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=len(mesh_shape)):
        shards = [
            AxisShard(a, p.dim, mesh_shape[a]) for a, p in enumerate(placements) if isinstance(p, Shard)
        ]
        sharded_axes = [s.axis for s in shards]
        blocks = shard_blocks(shape, shards)
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
            flat = 0
            for axis in sharded_axes:
                flat = flat * mesh_shape[axis] + coord[axis]
            block = blocks[flat]
            assert block_shape(block) == tuple(local)
            starts = tuple(dim[0][0] for dim in block)
            if block_numel(block):
                assert starts == tuple(offset)


def test_blocks_tile_the_matrix() -> None:
    blocks = shard_blocks((37, 24), [AxisShard(0, 0, 4)])
    covered = torch.zeros(37, 24, dtype=torch.int32)
    for block in blocks:
        for r0, r1 in block[0]:
            for c0, c1 in block[1]:
                covered[r0:r1, c0:c1] += 1
    assert torch.equal(covered, torch.ones_like(covered))
