"""The update rules on local tensors: pure elementwise math, no communication.

Every operation here is a single IEEE-rounded op per element (a multiply, an add, a divide, a square
root) between tensors of the same shape or a tensor and a scalar. Fused forms such as ``lerp`` or
``add(alpha=...)`` may take a fused multiply-add in a vectorized body and a plain multiply and add in a
scalar tail, so their result could depend on where an element sits in its buffer; single ops cannot.
That is why a shard updated here equals, bit for bit, the same rows of the full tensor updated here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["adamw_update", "adjust_lr", "apply_muon_update", "muon_momentum", "scale_updates"]


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's lr adjustment, from the *global* matrix shape (rows, cols)."""
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        # Keller Jordan: sqrt(max(1, A / B)) keeps the update's RMS consistent across aspect ratios.
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        # Moonshot, "Muon is Scalable for LLM Training" (arXiv 2502.16982): 0.2 * sqrt(max(A, B)).
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def _mul_(tensors: list[Tensor], scalars: float | Sequence[float]) -> None:
    """Multiply in place by Python scalars, as ``Tensor.mul_`` does (the scalar kept in fp32 math).

    torch 2.13's CPU ``_foreach_mul_`` rounds the scalar to a bf16/fp16 list's dtype first: bf16 params
    would decay by bf16(0.998) = 0.996, twice the weight decay asked for (tests/test_update.py). So
    only full-precision lists take the multi-tensor op.
    """
    if all(t.dtype in (torch.float32, torch.float64) for t in tensors):
        torch._foreach_mul_(tensors, scalars)
        return
    values = list(scalars) if isinstance(scalars, Sequence) else [scalars] * len(tensors)
    for t, v in zip(tensors, values):
        t.mul_(v)


def _copy_(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` (casting): one multi-tensor call when each list has one dtype.

    Mixed dtypes copy one tensor at a time: pytorch/pytorch#173383 (January 2026) reports CUDA's
    ``_foreach_copy_`` choosing its kernel from the first pair's dtypes and writing wrong values into
    destinations of another dtype, and we support torch releases from before its fix.
    """
    if len({t.dtype for t in dst}) <= 1 and len({t.dtype for t in src}) <= 1:
        torch._foreach_copy_(dst, src)
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
    scaled = torch._foreach_mul(list(grads), 1.0 - momentum)
    _mul_(list(bufs), momentum)
    torch._foreach_add_(list(bufs), scaled)
    source = list(bufs)
    if nesterov:
        source = torch._foreach_mul(source, momentum)
        torch._foreach_add_(source, scaled)
    _copy_(list(out), source)


def scale_updates(updates: Sequence[Tensor], out: Sequence[Tensor], adjusted_lrs: Sequence[float]) -> None:
    """``out <- adjusted_lr * update``, in ``out``'s dtype (the parameter's): a cast, then a multiply."""
    if not updates:
        return
    _copy_(list(out), list(updates))
    _mul_(list(out), list(adjusted_lrs))


def apply_muon_update(
    params: Sequence[Tensor], scaled_updates: Sequence[Tensor], *, lr: float, weight_decay: float
) -> None:
    """``param <- param (1 - lr wd) - scaled_update`` for each pair: decoupled weight decay tied to lr."""
    if not params:
        return
    if weight_decay != 0.0:
        _mul_(list(params), 1.0 - lr * weight_decay)
    torch._foreach_sub_(list(params), list(scaled_updates))


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step with torch.optim.AdamW's meaning (decoupled decay, bias correction)."""
    beta1, beta2 = betas
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad.mul(1.0 - beta1))
    exp_avg_sq.mul_(beta2).add_(grad.mul(grad).mul_(1.0 - beta2))
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps)
    param.sub_(exp_avg.div(denom).mul_(lr / bias_correction1))
