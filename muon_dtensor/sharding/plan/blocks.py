"""Where each rank's local block sits in the global matrix: plain frozen data from pure functions.

A block is, per tensor dimension, a tuple of half-open index intervals; the local tensor is the
Cartesian product of their concatenations. ``Shard`` gives one interval per dimension; placements
that interleave (``_StridedShard``) give several, so they extend this module rather than rewrite the
exchange. Everything here is computed from the global shape, the mesh shape and the placements, so it
is identical on every rank and testable without a process group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...base.weak_memo import WeakMemo

__all__ = [
    "Block",
    "Interval",
    "block_numel",
    "block_numels",
    "block_shape",
    "full_block",
    "mesh_blocks",
    "shard_blocks",
    "take",
]

Interval = tuple[int, int]
Block = tuple[tuple[Interval, ...], ...]


@dataclass(frozen=True)
class AxisShard:
    """One mesh axis that shards tensor dimension ``dim`` into ``size`` torch.chunk-style pieces.

    ``split_factor > 1`` is DTensor's ``_StridedShard`` (FSDP2 over tensor parallel): the index list
    is first cut into ``split_factor`` pieces, each piece into ``size`` chunks, and a rank holds its
    chunk of every piece, concatenated.
    """

    axis: int
    dim: int
    size: int
    split_factor: int = 1


def full_block(shape: Sequence[int]) -> Block:
    return tuple(((0, int(s)),) for s in shape)


def block_shape(block: Block) -> tuple[int, ...]:
    return tuple(sum(stop - start for start, stop in dim) for dim in block)


def block_numel(block: Block) -> int:
    return math.prod(block_shape(block))


_NUMELS: WeakMemo[tuple[int, ...]] = WeakMemo(limit=4096)  # block_numels' memo, per blocks tuple


def block_numels(blocks: Sequence[Block]) -> tuple[int, ...]:
    """``block_numel`` of each rank's block. A tuple's are counted once: matrices of one layout share
    one blocks tuple (``shard_blocks`` and ``mesh_blocks`` are cached), and a 1,024-rank plan reads
    every matrix's sizes many times (each rank's memory, the phases, both exchanges, the splits)."""
    if not isinstance(blocks, tuple):
        return tuple(block_numel(b) for b in blocks)
    hit = _NUMELS.get(blocks)
    if hit is not None:
        return hit
    return _NUMELS.put(blocks, tuple(block_numel(b) for b in blocks))


def _chunk(intervals: tuple[Interval, ...], pieces: int, index: int) -> tuple[Interval, ...]:
    """The ``index``-th of ``pieces`` chunks of an index list, with torch.chunk / DTensor semantics:
    every chunk has ceil(len / pieces) entries except the last non-empty one, and trailing chunks
    may be empty (DTensor ``Shard._local_shard_size_and_offset``)."""
    length = sum(stop - start for start, stop in intervals)
    chunk = -(-length // pieces) if length else 0
    lo, hi = min(index * chunk, length), min((index + 1) * chunk, length)
    return take(intervals, lo, hi) or ((0, 0),)


def take(intervals: Sequence[Interval], lo: int, hi: int) -> tuple[Interval, ...]:
    """Positions ``lo`` to ``hi`` of the concatenation of ``intervals``, as intervals of the
    indices they hold (empty when nothing is left)."""
    out: list[Interval] = []
    seen = 0
    for start, stop in intervals:
        a, b = max(lo - seen, 0), min(hi - seen, stop - start)
        if a < b:
            out.append((start + a, start + b))
        seen += stop - start
    return tuple(out)


def _apply(intervals: tuple[Interval, ...], shard: AxisShard, coord: int) -> tuple[Interval, ...]:
    if shard.split_factor == 1:
        return _chunk(intervals, shard.size, coord)
    out: list[Interval] = []
    for piece in range(shard.split_factor):
        out += [
            iv
            for iv in _chunk(_chunk(intervals, shard.split_factor, piece), shard.size, coord)
            if iv[0] < iv[1]
        ]
    return tuple(out) if out else ((0, 0),)


def _unravel(flat: int, sizes: Sequence[int]) -> list[int]:
    """The coordinates of row-major index ``flat`` in a grid of ``sizes``."""
    coords = []
    for size in reversed(sizes):
        coords.append(flat % size)
        flat //= size
    return coords[::-1]


def shard_blocks(shape: Sequence[int], shards: Sequence[AxisShard]) -> tuple[Block, ...]:
    """The block of every rank of the exchange group, in row-major order of the sharded mesh axes.

    ``shards`` lists the sharded mesh axes in mesh order; DTensor applies them in that order, each
    splitting what the previous ones left (so ``(Shard(0), Shard(0))`` nests).
    """
    return _shard_blocks(tuple(int(s) for s in shape), tuple(shards))


# A model's matrices share a few layouts: one (immutable) blocks tuple per layout, so plans of many
# parameters compute each once and share it (per-entry tables then dedup by identity).
@functools.lru_cache(maxsize=1024)
def _shard_blocks(shape: tuple[int, ...], shards: tuple[AxisShard, ...]) -> tuple[Block, ...]:
    sizes = [s.size for s in shards]
    blocks: list[Block] = []
    for flat in range(math.prod(sizes)):
        coords = _unravel(flat, sizes)
        dims = [list(d) for d in full_block(shape)]
        for shard, coord in zip(shards, coords):
            dims[shard.dim] = list(_apply(tuple(dims[shard.dim]), shard, coord))
        blocks.append(tuple(tuple(d) for d in dims))
    return tuple(blocks)


def mesh_blocks(
    shape: Sequence[int], mesh_shape: Sequence[int], shards: Sequence[AxisShard]
) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    """The block of every rank of the whole mesh (row-major over all its axes), and the replica each
    rank belongs to: the row-major index of its coordinates on the axes that do not shard (Replicate).
    The ranks of one replica hold every element once; replicas hold equal blocks."""
    return _mesh_blocks(tuple(int(s) for s in shape), tuple(int(m) for m in mesh_shape), tuple(shards))


@functools.lru_cache(maxsize=1024)
def _mesh_blocks(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], shards: tuple[AxisShard, ...]
) -> tuple[tuple[Block, ...], tuple[int, ...]]:
    sharded = [s.axis for s in shards]
    blocks = shard_blocks(shape, shards)
    out: list[Block] = []
    replica_of: list[int] = []
    for flat in range(math.prod(mesh_shape)):
        coords = _unravel(flat, mesh_shape)
        shard, replica = 0, 0
        for axis, coord in enumerate(coords):
            if axis in sharded:
                shard = shard * mesh_shape[axis] + coord
            else:
                replica = replica * mesh_shape[axis] + coord
        out.append(blocks[shard])
        replica_of.append(replica)
    return tuple(out), tuple(replica_of)
