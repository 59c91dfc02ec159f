"""Muon's and AdamW's elementwise rules on local tensors, and the buckets they run over: pure math.

Every operation here is a single IEEE-rounded op per element (a multiply, an add, a divide, a square
root) between tensors of the same shape or a tensor and a scalar. Fused forms such as ``lerp`` or
``add(alpha=...)`` may take a fused multiply-add in a vectorized body and a plain multiply and add in a
scalar tail, so their result could depend on where an element sits in its buffer; single ops cannot.
That is why a shard updated here equals, bit for bit, the same rows of the full tensor updated here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ..base.torch_ops import (
    foreach_add_,
    foreach_copy_,
    foreach_div,
    foreach_mul,
    foreach_mul_,
    foreach_scalar_op,
    foreach_sqrt,
    foreach_sub_,
)
from .cpu_scalars import scalar_of, scalars_of

__all__ = [
    "ADJUST_LR",
    "adamw_update",
    "adjust_lr",
    "apply_muon_update",
    "apply_results",
    "apply_updates",
    "buckets",
    "empty_like_all",
    "momentum_rule",
    "muon_momentum",
    "copy_all",
    "nesterov_inputs",
    "scale_results",
    "scale_updates",
    "wider",
]

# torch.optim.Muon's lr adjustments by name, each from the *global* matrix shape (rows, cols).
ADJUST_LR: dict[str | None, Callable[[int, int], float]] = {
    # Keller Jordan: sqrt(max(1, A / B)) keeps the update's RMS consistent across aspect ratios.
    None: lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    # Moonshot, "Muon is Scalable for LLM Training" (arXiv 2502.16982): 0.2 * sqrt(max(A, B)).
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    # Yang, Simon and Bernstein, "A Spectral Condition for Feature Learning" (arXiv 2310.17813):
    # spectral norm sqrt(fan_out / fan_in) for a (fan_out, fan_in) weight.
    "spectral": lambda rows, cols: math.sqrt(rows / cols),
}


def adjust_lr(lr: float, adjust_lr_fn: str | float | None, shape: Sequence[int]) -> float:
    """``lr`` times the adjustment of a matrix of global ``shape``: a name from ``ADJUST_LR``, or a
    number, the update RMS to match (validation checks both)."""
    rows, cols = int(shape[0]), int(shape[1])
    if isinstance(adjust_lr_fn, (int, float)):
        # An orthogonal (rows, cols) matrix has min(rows, cols) unit singular values, so its RMS is
        # 1 / sqrt(max(rows, cols)); 0.2 reproduces "match_rms_adamw".
        return lr * (adjust_lr_fn * math.sqrt(max(rows, cols)))
    return lr * ADJUST_LR[adjust_lr_fn](rows, cols)


Scalar = float | Tensor  # a Python float, or a 0-dim float64 tensor (capturable: on the device)


def _mul_(tensors: list[Tensor], scalars: Scalar | Sequence[Scalar]) -> None:
    """Multiply in place by Python scalars, as ``Tensor.mul_`` does (the scalar kept in fp32 math).

    torch 2.13's CPU ``_foreach_mul_`` rounds the scalar to a bf16/fp16 list's dtype first (0.998
    becomes 0.996: twice the weight decay; tests/numerics/test_update.py), so only fp32/fp64 lists take it.
    Tensor scalars (``capturable``) multiply per distinct scalar: each one multi-tensor call.
    """
    if isinstance(scalars, Tensor) or (
        isinstance(scalars, Sequence) and any(isinstance(s, Tensor) for s in scalars)
    ):
        _mul_by_tensors_(tensors, scalars)
        return
    floats = cast("float | list[float]", list(scalars) if isinstance(scalars, Sequence) else scalars)
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        if isinstance(floats, list):
            foreach_mul_(tensors, scalars_of(tensors, floats))
        else:
            foreach_mul_(tensors, scalar_of(tensors, floats))
        return
    values = floats if isinstance(floats, list) else [floats] * len(tensors)
    for t, v in zip(tensors, values):
        t.mul_(v)


def _mul_by_tensors_(tensors: list[Tensor], scalars: Scalar | Sequence[Scalar]) -> None:
    """``_mul_`` by 0-dim tensors: the tensors sharing a scalar in one call (a float64 CPU scalar
    multiplies as its Python float does, bit for bit: tests/optim/test_capturable.py)."""
    values = list(scalars) if isinstance(scalars, Sequence) else [scalars] * len(tensors)
    by_scalar: dict[int, list[int]] = {}
    for i, s in enumerate(values):
        by_scalar.setdefault(id(s), []).append(i)
    for index in by_scalar.values():
        scalar, members = values[index[0]], [tensors[i] for i in index]
        if all(t.dtype in (torch.float32, torch.float64) for t in members):
            foreach_mul_(members, scalar)
        else:
            for t in members:
                t.mul_(scalar)


def copy_all(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` (casting): one multi-tensor call when each list has one dtype.

    Mixed dtypes copy one tensor at a time: pytorch/pytorch#173383 (January 2026) reports CUDA's
    ``_foreach_copy_`` choosing its kernel from the first pair's dtypes and writing wrong values into
    destinations of another dtype, and we support torch releases from before its fix.
    """
    if len({t.dtype for t in dst}) <= 1 and len({t.dtype for t in src}) <= 1:
        foreach_copy_(dst, src)
        return
    for d, t in zip(dst, src):
        d.copy_(t)


def muon_momentum(
    bufs: Sequence[Tensor], grads: Sequence[Tensor], out: Sequence[Tensor], momentum: float, nesterov: bool
) -> None:
    """Update each ``buf`` in place to ``m buf + (1 - m) g``; write the Newton-Schulz input to ``out``.

    The same rule as torch.optim.Muon's ``buf.lerp_(g, 1 - m)`` and, with Nesterov, ``g.lerp(buf, m)``,
    as multi-tensor (``torch._foreach_*``) ops: a handful of kernel launches for a whole list on CUDA
    instead of several per parameter, each still one rounding per element. The copy into ``out``
    casts to its dtype (the Newton-Schulz dtype): the float result rounded once more, as ``.to`` would.
    """
    if not bufs:
        return
    if any(b.dtype != g.dtype for b, g in zip(bufs, grads)):
        _momentum_apart(list(bufs), list(grads), list(out), momentum, nesterov)
        return
    scaled = foreach_mul(list(grads), scalar_of(grads, 1.0 - momentum))
    _mul_(list(bufs), momentum)
    foreach_add_(list(bufs), scaled)
    source = list(bufs)
    if nesterov:
        source = list(foreach_mul(source, scalar_of(source, momentum)))
        foreach_add_(source, scaled)
    copy_all(list(out), source)


@functools.cache
def wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types(a, b)``, asked of torch once per pair: on the host it is an op of its
    own (``aten::promote_types``), which a per-matrix call would add to every step per matrix."""
    return torch.promote_types(a, b)


def _widened(tensors: list[Tensor], dtypes: list[torch.dtype]) -> list[Tensor]:
    """Each tensor in its dtype of ``dtypes``: itself where it has it, else a fresh exact copy."""
    out = list(tensors)
    fresh = [i for i, (t, d) in enumerate(zip(tensors, dtypes)) if t.dtype != d]
    if fresh:
        copies = empty_like_all([tensors[i] for i in fresh], [dtypes[i] for i in fresh])
        copy_all(copies, [tensors[i] for i in fresh])
        for i, copy in zip(fresh, copies):
            out[i] = copy
    return out


def _momentum_apart(
    bufs: list[Tensor], grads: list[Tensor], out: list[Tensor], momentum: float, nesterov: bool
) -> None:
    """``muon_momentum`` for a buffer kept in another dtype than its gradient (``momentum_dtype``):
    the same single ops in the wider of the two dtypes, on an exact copy of the buffer; the buffer
    stores the result rounded once to its dtype, and the Newton-Schulz input is formed from the
    unrounded result, so this step's update is the wide-momentum step's (docs/design.md)."""
    wide = [wider(b.dtype, g.dtype) for b, g in zip(bufs, grads)]
    work = empty_like_all(bufs, wide)
    copy_all(work, bufs)
    source = momentum_rule(work, grads, wide, momentum, nesterov)
    copy_all(bufs, work)
    copy_all(out, source)


def momentum_rule(
    work: list[Tensor], grads: list[Tensor], wide: list[torch.dtype], momentum: float, nesterov: bool
) -> list[Tensor]:
    """``work <- m work + (1 - m) g`` in place, on ``grads`` widened to ``wide`` (``work``'s
    dtypes, float32 or float64); returns the Newton-Schulz source: ``work``, or with Nesterov
    ``(1 - m) g + m work`` as fresh tensors."""
    widened = _widened(grads, wide)
    scaled = foreach_mul(widened, scalar_of(widened, 1.0 - momentum))
    _mul_(work, momentum)
    foreach_add_(work, scaled)
    if not nesterov:
        return work
    source = list(foreach_mul(work, scalar_of(work, momentum)))
    foreach_add_(source, scaled)
    return source


def scale_updates(updates: Sequence[Tensor], out: Sequence[Tensor], adjusted_lrs: Sequence[Scalar]) -> None:
    """``out <- adjusted_lr * update``, in ``out``'s dtype (the parameter's): a cast, then a multiply."""
    if not updates:
        return
    copy_all(list(out), list(updates))
    _mul_(list(out), list(adjusted_lrs))


def apply_muon_update(
    params: Sequence[Tensor], scaled_updates: Sequence[Tensor], *, lr: Scalar, weight_decay: float
) -> None:
    """``param <- param (1 - lr wd) - scaled_update`` for each pair: decoupled weight decay tied to lr."""
    if not params:
        return
    if weight_decay != 0.0:
        _mul_(list(params), 1.0 - lr * weight_decay)
    foreach_sub_(list(params), list(scaled_updates))


# Elementwise work runs as multi-tensor ops over buckets of local elements: on CUDA big buckets (few
# launches, temporaries bounded); on CPU cache-sized flat pieces, which stay in cache across an op's
# passes (docs/benchmarks.md). Every op is exact per element, so the bucketing changes no bit.
BUCKET_ELEMENTS = 1 << 26
CPU_PIECE_ELEMENTS = 1 << 17
# momentum_dtype's pass (a buffer of another dtype than its gradient) issues three more ops per
# bucket than the same-dtype pass (its wide copy made, filled and stored): on CPU its pieces are
# twice as long, so its host ops per element stay at most the float32 pass's.
APART_PIECES = 2


def buckets(
    groups: Sequence[Sequence[Tensor]], cpu_pieces: int = 1
) -> Iterator[tuple[list[int], list[list[Tensor]]]]:
    """Aligned pieces of ``groups`` (``groups[k][i]`` alike in shape for every k), in buckets; yields
    (index of each piece's tensor, pieces per group). On CPU, contiguous tensors are cut into flat
    ranges of ``cpu_pieces`` times ``CPU_PIECE_ELEMENTS``, each its own bucket."""
    if not groups or not groups[0]:
        return
    cpu = groups[0][0].device.type == "cpu"
    limit = cpu_pieces * CPU_PIECE_ELEMENTS if cpu else BUCKET_ELEMENTS
    sizes = [t.numel() for t in groups[0]]
    if not cpu or max(sizes) <= limit:  # no tensor is cut: the same buckets, as runs of whole tensors
        yield from _runs(groups, sizes, limit)
        return
    index: list[int] = []
    bucket: list[list[Tensor]] = [[] for _ in groups]
    size = 0
    for i in range(len(groups[0])):
        whole = [g[i] for g in groups]
        n = whole[0].numel()
        parts = [whole]
        if cpu and n > limit and all(t.is_contiguous() for t in whole):
            parts = [[t.view(-1)[a : a + limit] for t in whole] for a in range(0, n, limit)]
        for part in parts:
            if size and size + part[0].numel() > limit:
                yield index, bucket
                index, bucket, size = [], [[] for _ in groups], 0
            index.append(i)
            for k, t in enumerate(part):
                bucket[k].append(t)
            size += part[0].numel()
    if index:
        yield index, bucket


def _runs(
    groups: Sequence[Sequence[Tensor]], sizes: list[int], limit: int
) -> Iterator[tuple[list[int], list[list[Tensor]]]]:
    """``buckets`` where no tensor is cut: each bucket a run of whole tensors, sliced from the
    lists rather than built element by element (a host cost per tensor per pass on a step of
    thousands of small matrices)."""
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if size and size + n > limit:
            yield list(range(start, i)), [list(g[start:i]) for g in groups]
            start, size = i, 0
        size += n
    yield list(range(start, len(sizes))), [list(g[start:]) for g in groups]


def empty_like_all(tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype] | None = None) -> list[Tensor]:
    """Fresh contiguous tensors shaped like ``tensors`` (in ``dtypes``, else theirs): one allocation
    and one row split per trailing shape, dtype and device, not one allocation per tensor (each is
    host work per step, and on a GPU a dispatch)."""
    if not tensors:
        return []
    dtypes = list(dtypes) if dtypes is not None else [t.dtype for t in tensors]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for shape, dtype, device, index in _by_kind(tensors, dtypes):
        groups.setdefault((tuple(shape[1:]), len(shape), dtype, device), []).extend(index)
    for index in groups.values():
        index.sort()  # each shape's tensors in list order, as one pass over the list puts them
    out: list[Tensor] = [tensors[0]] * len(tensors)
    for (tail, ndim, dtype, device), index in groups.items():
        if ndim == 0 or len(index) == 1:
            for i in index:
                out[i] = torch.empty(tensors[i].shape, dtype=dtype, device=device)
            continue
        rows = [int(tensors[i].shape[0]) for i in index]
        pieces = torch.empty((sum(rows), *tail), dtype=dtype, device=device).split(rows)
        for i, piece in zip(index, pieces):
            out[i] = piece
    return out


def _by_kind(
    tensors: Sequence[Tensor], dtypes: Sequence[torch.dtype]
) -> list[tuple[torch.Size, torch.dtype, torch.device, list[int]]]:
    """The positions of each (shape, dtype, device) among ``tensors``: a key built from cheap
    attributes per tensor, the rest per kind (a host cost per tensor on a step of thousands)."""
    kinds: dict[tuple[Any, ...], list[int]] = {}
    for i, key in enumerate([(t.shape, d, t.device) for t, d in zip(tensors, dtypes)]):
        kinds.setdefault(key, []).append(i)
    return [(shape, dtype, device, index) for (shape, dtype, device), index in kinds.items()]


def nesterov_inputs(
    bufs: Sequence[Tensor], grads: Sequence[Tensor], momentum: float, nesterov: bool, dtype: torch.dtype
) -> list[Tensor]:
    """Update the momentum ``bufs`` in place; return the Newton-Schulz inputs, fresh and contiguous."""
    ns_in = empty_like_all(bufs, [dtype] * len(bufs))
    apart = any(b.dtype != g.dtype for b, g in zip(bufs, grads))
    for _, (b, g, out) in buckets([bufs, grads, ns_in], APART_PIECES if apart else 1):
        muon_momentum(b, g, out, momentum, nesterov)
    return ns_in


def scale_results(
    results: Sequence[Tensor], dtypes: Sequence[torch.dtype], lrs: Sequence[Scalar]
) -> list[Tensor]:
    """Each result times its adjusted lr, in its parameter's dtype: fresh contiguous tensors."""
    scaled = empty_like_all(results, dtypes)
    for index, (src, dst) in buckets([results, scaled]):
        scale_updates(src, dst, [lrs[i] for i in index])
    return scaled


def apply_results(
    params: Sequence[Tensor],
    results: Sequence[Tensor],
    lrs: Sequence[Scalar],
    *,
    lr: Scalar,
    weight_decay: float,
) -> None:
    """``param <- param (1 - lr wd) - adjusted_lr * result`` where a result is a parameter's whole update.

    Scaled bucket by bucket, so no parameter-sized scaled tensor is allocated (fresh memory costs
    page faults on CPU; docs/benchmarks.md)."""
    results = [o if o.shape == p.shape else o.reshape(p.shape) for o, p in zip(results, params)]
    for index, (p, o) in buckets([list(params), results]):
        scaled = empty_like_all(o, [t.dtype for t in p])
        scale_updates(o, scaled, [lrs[i] for i in index])
        apply_muon_update(p, scaled, lr=lr, weight_decay=weight_decay)


def apply_updates(
    params: Sequence[Tensor], updates: Sequence[Tensor], *, lr: Scalar, weight_decay: float
) -> None:
    """``param <- param (1 - lr wd) - update`` for already scaled, assembled updates."""
    for _, (p, u) in buckets([list(params), list(updates)]):
        apply_muon_update(p, u, lr=lr, weight_decay=weight_decay)


def _scalar_op(name: str, tensors: list[Tensor], scalar: float, *, inplace: bool) -> list[Tensor]:
    """``torch._foreach_<name>[_](tensors, scalar)`` where that keeps the scalar in fp32 math (fp32
    and fp64 lists; see ``_mul_``), else the same op one tensor at a time."""
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        op = foreach_scalar_op(name, inplace=inplace)
        out = op(tensors, scalar_of(tensors, scalar) if name == "mul" else scalar)
        return tensors if inplace else list(out)
    return [getattr(t, f"{name}_" if inplace else name)(scalar) for t in tensors]


def adamw_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step with torch.optim.AdamW's meaning (decoupled decay, bias correction) on lists of
    tensors that share ``step``: multi-tensor ops, each one rounding per element, in the order of
    torch's single-tensor AdamW."""
    if not params:
        return
    p, g, m, v = list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)
    beta1, beta2 = betas
    _scalar_op("mul", p, 1.0 - lr * weight_decay, inplace=True)
    _scalar_op("mul", m, beta1, inplace=True)
    foreach_add_(m, _scalar_op("mul", g, 1.0 - beta1, inplace=False))
    _scalar_op("mul", v, beta2, inplace=True)
    foreach_add_(v, _scalar_op("mul", list(foreach_mul(g, g)), 1.0 - beta2, inplace=True))
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = _scalar_op("div", list(foreach_sqrt(v)), bias_correction2_sqrt, inplace=True)
    _scalar_op("add", denom, eps, inplace=True)
    update = _scalar_op("mul", list(foreach_div(m, denom)), lr / bias_correction1, inplace=True)
    foreach_sub_(p, update)
