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

__all__ = ["adamw_update", "adjust_lr", "apply_muon_update", "muon_momentum", "scale_update"]


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


def muon_momentum(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool, dtype: torch.dtype) -> Tensor:
    """Update ``buf`` in place to ``m buf + (1 - m) g``; return the Newton-Schulz input in ``dtype``.

    The same rule as torch.optim.Muon's ``buf.lerp_(g, 1 - m)`` and, with Nesterov, ``g.lerp(buf, m)``.
    The last add writes ``dtype`` directly: it rounds the float sum to ``dtype`` in the same pass,
    which is the cast that would follow, so one pass over memory less and the same bits.
    """
    scaled = grad.mul(1.0 - momentum)
    buf.mul_(momentum).add_(scaled)
    if not nesterov:
        return buf.to(dtype)
    out = torch.empty_like(buf, dtype=dtype, memory_format=torch.contiguous_format)
    return torch.add(scaled, buf.mul(momentum), out=out)


def scale_update(update: Tensor, dtype: torch.dtype, adjusted_lr: float) -> Tensor:
    """``adjusted_lr * update`` in the parameter's dtype (a fresh tensor unless dtypes match)."""
    return update.to(dtype).mul_(adjusted_lr)


def apply_muon_update(param: Tensor, scaled_update: Tensor, *, lr: float, weight_decay: float) -> None:
    """``param <- param (1 - lr wd) - scaled_update``, decoupled weight decay tied to lr."""
    if weight_decay != 0.0:
        param.mul_(1.0 - lr * weight_decay)
    param.sub_(scaled_update)


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
