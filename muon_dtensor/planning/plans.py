"""The plans the cost model prices: matrices laid out as FSDP2 and HSDP lay them out, and the per-rank
memory ``Muon.memory`` predicts on them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from ..numerics.blockwise import absmax_shape
from ..sharding.plan.blocks import AxisShard, Block, block_shape, mesh_blocks, shard_blocks
from ..sharding.plan.build import MatrixEntry, Plan, build_plan
from ..sharding.plan.memory import group_peak
from .links import block_numels
from .shapes import Shape

__all__ = ["MOMENTUM_ITEMS", "hsdp_plan", "rank_memory", "sharded_plan"]


@lru_cache(maxsize=4096)
def _blocks(shape: Shape, ranks: int) -> tuple[Block, ...]:
    return shard_blocks(shape, [AxisShard(0, 0, ranks)])


def sharded_plan(
    shapes: Sequence[Shape], world_size: int, mode: str = "owner", max_round_bytes: int | None = None
) -> Plan:
    """The plan for ``shapes`` laid out as FSDP2 does (``Shard(0)`` over ``world_size`` ranks)."""
    entries = [MatrixEntry(tuple(s), _blocks(tuple(s), world_size)) for s in shapes]  # type: ignore[arg-type]
    return build_plan(entries, world_size, mode, max_round_bytes=max_round_bytes)


@lru_cache(maxsize=4096)
def _mesh_blocks(shape: Shape, shards: int, replicas: int) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    return mesh_blocks(shape, (replicas, shards), [AxisShard(1, 0, shards)])


def hsdp_plan(
    shapes: Sequence[Shape],
    shards: int,
    replicas: int,
    mode: str = "owner",
    max_round_bytes: int | None = None,
) -> Plan:
    """The plan with owners over the whole mesh for ``shapes`` laid out as HSDP does: ``(Replicate,
    Shard(0))`` on a ``(replicas, shards)`` mesh."""
    entries = []
    for s in shapes:
        blocks, replica_of = _mesh_blocks(tuple(s), shards, replicas)
        entries.append(MatrixEntry(tuple(s), blocks, replica_of=replica_of))  # type: ignore[arg-type]
    return build_plan(entries, shards * replicas, mode, max_round_bytes=max_round_bytes)


@lru_cache(maxsize=64)
def rank_memory(
    shapes: tuple[Shape, ...],
    shard: int,
    replicate: int,
    mesh: bool,
    limit: int | None,
    momentum_dtype: str = "float32",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank of one exchange group, the bytes ``Muon.memory`` reports for ``shapes`` of float32
    parameters: momentum in ``momentum_dtype`` and the predicted peak transient of a step (bf16
    exchange, CUDA batches), from the plan the optimizer would build (``mesh``: owners over
    ``replicate`` x ``shard`` ranks, else one shard group); ``limit``: bytes per round. Computed once
    per setting (pure; seconds at 1,024 ranks)."""
    built = (
        hsdp_plan(shapes, shard, replicate, max_round_bytes=limit)
        if mesh
        else sharded_plan(shapes, shard, max_round_bytes=limit)
    )
    whole, members = [False] * len(built.entries), list(range(len(built.entries)))
    momentum, peak = [], []
    per_entry = [block_numels(e.blocks) for e in built.entries]
    item = MOMENTUM_ITEMS[momentum_dtype]
    for rank in range(built.group_size):
        numels = [x[rank] for x in per_entry]
        momentum.append(item * sum(numels) + (_maxima(built.entries, rank) if item == 1 else 0))
        peak.append(
            group_peak(
                numels, whole, [(built, rank, members)], param_item=4, ns_item=2, nesterov=True, cpu=False,
                momentum_item=0 if item == 4 else item,
            )
        )  # fmt: skip
    return tuple(momentum), tuple(peak)


MOMENTUM_ITEMS = {"float32": 4, "bfloat16": 2, "int8": 1}  # plan --momentum-dtype: bytes per element


def _maxima(entries: Sequence[MatrixEntry], rank: int) -> int:
    """int8 momentum's float32 block maxima on ``rank``: its rows' blocks of 256 columns (blockwise)."""
    shapes = [block_shape(e.blocks[rank]) for e in entries]
    return sum(4 * math.prod(absmax_shape(s)) for s in shapes if math.prod(s))
