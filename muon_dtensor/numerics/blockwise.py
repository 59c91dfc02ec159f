"""8-bit blockwise momentum (``momentum_dtype=torch.int8``): pure math on local tensors.

Linear blockwise quantization as 8-bit Muon defines it (Gupta et al., "Effective Quantization of
Muon Optimizer States", arXiv 2509.23106): per block, ``q = round(127 x / absmax)`` kept as int8 and
``absmax`` kept in float32; ``x~ = (absmax / 127) q``. The paper's blocks are 2,048 consecutive
elements of the flattened tensor. Ours are ``BLOCK`` consecutive elements of one row (the last
dimension), counted from the row's start on the full tensor: a row shard (FSDP, colwise TP) never
splits one, and a column shard keeps them whole where its columns start on a multiple of ``BLOCK``
(``block_problem`` says where not). Each block's result depends on its own elements only, so a
shard quantizes exactly as the full tensor does and DCP reshards the pair to any layout exactly.

The step dequantizes once, runs the momentum rule in float32 (float64 for float64 gradients), rounds
the new momentum once into its blocks, and forms the Newton-Schulz input from the unrounded
momentum, as ``momentum_dtype=torch.bfloat16`` does. Same-shape tensors are stacked, so the host's
ops grow with the number of local shapes, not of parameters.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .elementwise import copy_all, empty_like_all, wider

__all__ = [
    "BLOCK",
    "absmax_shape",
    "block_problem",
    "chunk_elements",
    "dequantize",
    "device_memory",
    "int8_momentum",
    "int8_nesterov_inputs",
    "quantize",
]

# Elements per block along a row. 2,048 (the paper's) would keep a row-parallel TP shard of
# Llama-3-8B's down projection (14,336 / 8 = 1,792 columns) from starting on a block; 256 divides
# the row-parallel column shards of Llama-3 at TP 8 (8B) and TP 16 (70B, 405B), and its float32
# maximum adds 4 / 256 of a byte per element (25.4% of float32 momentum in all).
BLOCK = 256
LEVELS = 127.0  # symmetric int8: -127..127
# Elements per stacked chunk of the momentum pass: its float32 working copies stay bounded however
# large a group is, while the host issues ops per chunk, not per parameter. A chunk takes up to
# 1 / CHUNK_MEMORY_SHARE of its device's memory at CHUNK_BYTES per element (the float32 copies
# sharding/plan/memory.py counts, and the int8 result), and at least CHUNK_ELEMENTS: a fixed 2**22
# split every Llama-3-8B matrix into a chunk of its own, so int8's host ops grew with depth.
CHUNK_ELEMENTS = 1 << 22
CHUNK_MEMORY_SHARE = 64
CHUNK_BYTES = 18


def chunk_elements(memory_bytes: int | None) -> int:
    """Elements per stacked chunk on a device of ``memory_bytes`` (None: unknown, the floor)."""
    return max(CHUNK_ELEMENTS, (memory_bytes or 0) // (CHUNK_MEMORY_SHARE * CHUNK_BYTES))


@functools.cache
def device_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes: a GPU's own, the host's physical memory for the CPU,
    None where torch does not say (read once per device: the step asks at every call)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None


def absmax_shape(shape: Sequence[int], block: int = BLOCK) -> tuple[int, ...]:
    """The shape of a tensor's block maxima: its last dimension counted in blocks."""
    return (*shape[:-1], math.ceil(shape[-1] / block)) if len(shape) else ()


def block_problem(cols: int, starts_and_ends: Sequence[tuple[int, int]], block: int = BLOCK) -> str | None:
    """Why shards of a row of ``cols`` columns, each the column range [start, end), would split a
    block; None if none does (every shard starts on a block and ends on one or at the row's end)."""
    for start, end in starts_and_ends:
        if start == end:
            continue
        if start % block or (end % block and end != cols):
            return (
                f"a shard holds columns [{start}, {end}) of {cols}, which cuts a block of {block} "
                "columns of the 8-bit momentum"
            )
    return None


def _parts(cols: int, block: int) -> list[tuple[int, int, int]]:
    """A row's whole blocks and its short last block, as (start, blocks, width): each part is a view
    ``x[..., start:start + blocks * width].unflatten(-1, (blocks, width))`` with no copy."""
    whole = cols // block
    parts = [(0, whole, block)] if whole else []
    if cols % block:
        parts.append((whole * block, 1, cols % block))
    return parts


def _view(x: Tensor, part: tuple[int, int, int]) -> Tensor:
    start, blocks, width = part
    return x[..., start : start + blocks * width].unflatten(-1, (blocks, width))


def quantize(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``x`` as int8 blocks and their float32 maxima (``absmax_shape``). All-zero blocks stay 0."""
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    maxima = []
    for part in _parts(x.shape[-1], block):
        blocks = _view(x, part)
        absmax = blocks.abs().amax(dim=-1).to(torch.float32)
        divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).to(x.dtype)
        # x * 127 overflows float32 above 2.7e36: a block of maximum >= 1 takes 127/128 and its
        # divisor / 128 instead, both exact (a power of two), so the quotient rounds to the same bits
        shrink = torch.where(divisor >= 1, 1 / 128, 1.0).to(x.dtype)
        levels, divisor = (shrink * LEVELS).unsqueeze(-1), (divisor * shrink).unsqueeze(-1)
        _view(q, part).copy_(torch.round(blocks * levels / divisor))
        maxima.append(absmax)
    return q, maxima[0] if len(maxima) == 1 else torch.cat(maxima, dim=-1)


def dequantize(q: Tensor, absmax: Tensor, dtype: torch.dtype, block: int = BLOCK) -> Tensor:
    """The values of int8 blocks ``q`` with maxima ``absmax``, in ``dtype`` (float32 or wider)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    step = (absmax / LEVELS).to(dtype).unsqueeze(-1)
    first = 0
    for part in _parts(q.shape[-1], block):
        blocks = part[1]
        torch.mul(step[..., first : first + blocks, :], _view(q, part).to(dtype), out=_view(out, part))
        first += blocks
    return out


def _chunks(tensors: Sequence[Tensor], grads: Sequence[Tensor]) -> list[list[int]]:
    """Indices of non-empty ``tensors`` grouped by shape, device and gradient dtype, in chunks of at
    most ``chunk_elements`` of their device (one tensor at least): each chunk's ops run on one
    stacked batch."""
    groups: dict[tuple[Any, ...], list[list[int]]] = {}
    for i, t in enumerate(tensors):
        if not t.numel():
            continue
        chunks = groups.setdefault((tuple(t.shape), t.device, grads[i].dtype), [[]])
        if chunks[-1] and (len(chunks[-1]) + 1) * t.numel() > chunk_elements(device_memory(t.device)):
            chunks.append([])
        chunks[-1].append(i)
    return [c for chunks in groups.values() for c in chunks]


def _stacked(tensors: Sequence[Tensor], index: Sequence[int]) -> Tensor:
    return torch.stack([tensors[i] for i in index])


def _unstack_into(dst: Sequence[Tensor], index: Sequence[int], values: Tensor) -> None:
    copy_all([dst[i] for i in index], list(values.unbind(0)))


def int8_momentum(
    qs: Sequence[Tensor],
    absmaxes: Sequence[Tensor],
    grads: Sequence[Tensor],
    out: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
) -> None:
    """``elementwise.muon_momentum`` for 8-bit buffers, one stacked chunk at a time: dequantize, the
    same single ops in float32 (or the gradient's wider dtype), round the new momentum once into
    ``qs``/``absmaxes``, and write the Newton-Schulz input from the unrounded momentum to ``out``."""
    for index in _chunks(qs, grads):
        wide = wider(torch.float32, grads[index[0]].dtype)
        work = dequantize(_stacked(qs, index), _stacked(absmaxes, index), wide)
        scaled = _stacked(grads, index).to(wide) * (1.0 - momentum)
        work = work * momentum + scaled  # two single roundings: as momentum_rule's mul_ then add_
        q, absmax = quantize(work)
        _unstack_into(qs, index, q)
        _unstack_into(absmaxes, index, absmax)
        _unstack_into(out, index, work * momentum + scaled if nesterov else work)


def int8_nesterov_inputs(
    qs: Sequence[Tensor],
    absmaxes: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
    dtype: torch.dtype,
) -> list[Tensor]:
    """``elementwise.nesterov_inputs`` for 8-bit buffers: update them in place; return the
    Newton-Schulz inputs in ``dtype``, fresh and contiguous."""
    ns_in = empty_like_all(qs, [dtype] * len(qs))
    int8_momentum(qs, absmaxes, grads, ns_in, momentum, nesterov)
    return ns_in
