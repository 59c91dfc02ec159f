"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534, section 2.1) on plain or sharded q/k weights.

After an optimizer step, a head ``h`` whose largest pre-softmax logit ``s_h`` (``q.k / sqrt(head_dim)``,
max over the step's batch) exceeds ``threshold`` gets its query rows scaled by
``(threshold / s_h) ** alpha`` and its key rows by ``(threshold / s_h) ** (1 - alpha)``: the product
is ``threshold / s_h``, so that head's largest logit on that batch becomes ``threshold``. Heads at or
below the threshold are untouched. Only the weights change; optimizer state (momentum) does not.

Every rank must scale by the same factors, so ``s_h`` is the MAX over every rank of the weights'
mesh before anything is computed from it (ms-swift's MuonClip applied process-local maxima and its
data-parallel replicas drifted apart until it all-reduced them, modelscope/ms-swift#9901).

Exactness: the factors are computed in float32 on the host from the reduced maxima, identical bits
on every rank; each weight element is then multiplied once by its head's float32 factor (one
elementwise op, the result rounded to the weight's dtype), so a shard's rows come out as the same
rows of the one-process result, on any layout.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ._sharding import comm
from ._sharding.blocks import AxisShard, Interval, shard_blocks
from ._sharding.param_layout import _shards, check_placements, local_of

__all__ = ["QKClipFactors", "qk_clip_", "qk_clip_factors"]


class QKClipFactors(NamedTuple):
    """What ``qk_clip_`` did, for logging: float32 factors per query head ``[num_heads]`` and per key
    head ``[num_kv_heads]`` (1.0 where nothing was clipped), and the global max logits it used."""

    q: Tensor
    k: Tensor
    max_logits: Tensor


# ----------------------------------------------------------------------------- pure math
def qk_clip_factors(
    max_logits: Tensor, num_kv_heads: int, *, threshold: float = 100.0, alpha: float = 0.5
) -> tuple[Tensor, Tensor]:
    """Float32 (query factors ``[num_heads]``, key factors ``[num_kv_heads]``) from global max logits.

    ``eta_h = threshold / s_h`` where ``s_h > threshold``, else 1 (also for ``-inf``: a head nobody
    computed). Query head ``h`` gets ``eta_h ** alpha``. Under GQA query head ``h`` reads key head
    ``h // (num_heads // num_kv_heads)`` (Hugging Face's ``repeat_kv``), and a key head shared by
    several query heads takes the smallest ``eta ** (1 - alpha)`` among them, so no query head that
    reads it keeps a logit above the threshold. No communication.
    """
    if max_logits.ndim != 1 or num_kv_heads < 1 or max_logits.numel() % num_kv_heads:
        raise ValueError(
            f"qk_clip_factors: max_logits has shape {tuple(max_logits.shape)}, which is not one value per query "
            f"head for {num_kv_heads} key heads; pass [num_heads] with num_heads a multiple of num_kv_heads"
        )
    s = max_logits.detach().float()
    # A tensor numerator: ``float / tensor`` is reciprocal-then-multiply (two roundings) in torch.
    eta = torch.where(s > threshold, torch.full_like(s, threshold) / s, torch.ones_like(s))
    q = eta.pow(alpha)
    k = eta.pow(1.0 - alpha).view(num_kv_heads, -1).amin(dim=1)
    return q, k


@functools.lru_cache(maxsize=512)
def _row_intervals(shape: tuple[int, ...], shards: tuple[AxisShard, ...], flat: int) -> tuple[Interval, ...]:
    """This rank's row intervals (cached: shard_blocks lists every rank's block)."""
    return shard_blocks(shape, shards)[flat][0]


def local_rows(w: Tensor, name: str) -> Tensor:
    """The global row index of each row of ``w``'s local tensor, in local order: every row for a
    plain tensor or a DTensor whose rows are not sharded; this rank's block rows otherwise (any
    supported placement: Shard, uneven and empty shards, _StridedShard)."""
    if not isinstance(w, DTensor):
        return torch.arange(w.shape[0])
    shards = tuple(_shards(w, name))
    coord = w.device_mesh.get_coordinate()
    assert coord is not None, "check_placements refused ranks outside the mesh"
    flat = 0
    for s in shards:  # shard_blocks' order: row-major over the sharded mesh axes
        flat = flat * s.size + coord[s.axis]
    intervals = _row_intervals(tuple(w.shape), shards, flat) if shards else ((0, w.shape[0]),)
    return torch.cat([torch.arange(a, b) for a, b in intervals])


def _scale_rows_(w: Tensor, factors: Tensor, head_dim: int, name: str) -> None:
    """Multiply each local row of ``w`` by its head's factor, in place (one op per element)."""
    local = local_of(w)
    if local.numel() == 0:  # an empty FSDP2 piece may be (0, 0)
        return
    rows = local_rows(w, name)
    assert local.shape[0] == rows.numel(), f"{name}: local rows {local.shape[0]} vs layout {rows.numel()}"
    per_row = factors[rows // head_dim].to(local.device)
    # float32 factor, weight-dtype result: a bf16 weight times an f32 factor is an f32 product, rounded
    # to bf16 on store; the same per element wherever the element sits.
    local.mul_(per_row.unsqueeze(1))


# ----------------------------------------------------------------------------- checks
def _bad(what: str) -> ValueError:
    return ValueError(f"qk_clip_: {what}")


def _check_weight(w: object, name: str, head_dim: int) -> int:
    """The number of heads of weight ``w``; raises naming ``name``."""
    if not isinstance(w, Tensor) or w.ndim != 2 or not w.dtype.is_floating_point:
        what = f"a {w.ndim}-D {w.dtype} tensor" if isinstance(w, Tensor) else type(w).__name__
        raise _bad(
            f"{name} should be a 2-D floating-point nn.Linear weight [heads * head_dim, in] but is {what}"
        )
    if w.shape[0] % head_dim:
        raise _bad(
            f"{name} has {w.shape[0]} rows, not a multiple of head_dim={head_dim}; pass the projection's "
            "nn.Linear weight [heads * head_dim, in] (not transposed) and the width of one head"
        )
    check_placements(w, name)
    return w.shape[0] // head_dim


def _check(q: Tensor, k: Tensor, head_dim: int, threshold: float, alpha: float) -> tuple[int, int]:
    """The arguments every rank passes alike, checked before the collective (metadata only, so every
    rank raises the same error). Returns (query heads, key heads)."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise _bad(f"head_dim should be a positive int but is {head_dim!r}; pass the width of one head")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise _bad(f"threshold should be a finite number > 0 but is {threshold!r}; Kimi K2 uses 100.0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise _bad(f"alpha should be between 0 and 1 but is {alpha!r}; 0.5 scales q and k alike")
    heads, kv_heads = _check_weight(q, "q_weight", head_dim), _check_weight(k, "k_weight", head_dim)
    if heads % kv_heads:
        raise _bad(
            f"q_weight has {heads} heads and k_weight {kv_heads} (head_dim={head_dim}): the query heads "
            "should be a multiple of the key heads; check head_dim and the order of q_weight, k_weight"
        )
    _check_same_mesh(q, k)
    return heads, kv_heads


def _check_same_mesh(q: Tensor, k: Tensor) -> None:
    qm = q.device_mesh if isinstance(q, DTensor) else None
    km = k.device_mesh if isinstance(k, DTensor) else None
    if qm != km:
        raise _bad(
            f"q_weight and k_weight should be on the same device mesh (or both plain tensors) but q_weight "
            f"is on {qm} and k_weight on {km}; pass the q and k weights of one attention layer"
        )


# ----------------------------------------------------------------------------- collective
_WRONG, _BROKEN = 0, 1  # slots of the problem flags sent with the values


def _local_values(max_logits: object, heads: int) -> tuple[Tensor, int | None, str]:
    """This rank's values (float32, host), its problem slot or None, and what it passed. max_logits is
    the one argument that differs per rank, so its problems travel in the collective."""
    if not isinstance(max_logits, Tensor) or isinstance(max_logits, DTensor):
        return torch.full((heads,), -math.inf), _WRONG, type(max_logits).__name__
    shown = f"{max_logits.dtype} of shape {tuple(max_logits.shape)}"
    if tuple(max_logits.shape) != (heads,) or not max_logits.dtype.is_floating_point:
        return torch.full((heads,), -math.inf), _WRONG, shown
    values = max_logits.detach().float().cpu()
    broken = bool((values.isnan() | (values == math.inf)).any())
    return values, _BROKEN if broken else None, shown


def _global_max(max_logits: Tensor, q: Tensor, heads: int) -> Tensor:
    """The elementwise MAX of ``max_logits`` over the weights' mesh (the default group for plain
    tensors, nothing without one), float32 on the host. The one collective also carries each rank's
    problems with its ``max_logits``, so a bad value on one rank raises on every rank instead of
    leaving the others waiting."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    values, problem, shown = _local_values(max_logits, heads)
    flags = torch.zeros(2)
    if problem is not None:
        flags[problem] = rank + 1.0  # MAX keeps the highest failing rank
    sent = torch.cat([values, flags])
    if isinstance(q, DTensor):
        sent = comm.max_over_mesh(sent, q.device_mesh)
    elif distributed:
        sent = comm.max_over_group(sent, None, q.device.type)
    wrong, broken = int(sent[heads + _WRONG]) - 1, int(sent[heads + _BROKEN]) - 1
    here = f" (this rank passed {shown})" if problem is not None else ""
    if wrong >= 0:
        raise _bad(
            f"max_logits should be a plain float tensor of shape ({heads},), one value per query head (-inf "
            f"for heads a rank did not compute), but rank {wrong} passed another{here}; no weight changed"
        )
    if broken >= 0:
        raise _bad(
            f"max_logits holds NaN or +inf on rank {broken}{here}; every rank raises this and no weight "
            "changed. The forward pass overflowed: find the NaN, or skip QK-Clip for this step"
        )
    return sent[:heads]


@torch.no_grad()
def qk_clip_(
    q_weight: Tensor,
    k_weight: Tensor,
    max_logits: Tensor,
    *,
    head_dim: int,
    threshold: float = 100.0,
    alpha: float = 0.5,
) -> QKClipFactors:
    """QK-Clip one attention layer in place; returns the factors (``QKClipFactors``) for logging.

    Args:
        q_weight: the query projection's ``nn.Linear`` weight ``[num_heads * head_dim, hidden]``, a
            plain tensor or a DTensor in any layout the optimizer supports (FSDP2, HSDP, TP, FSDP x TP).
        k_weight: the key projection's weight ``[num_kv_heads * head_dim, hidden]``, on the same mesh.
        max_logits: float ``[num_heads]``: this rank's largest ``q.k / sqrt(head_dim)`` per query head
            over its batch since the last clip; ``-inf`` for a head it did not compute (tensor parallel).
        head_dim: the width of one head.
        threshold: tau; heads whose global max logit exceeds it are scaled down to it. Default 100.0.
        alpha: the share of the scaling on q: q rows by ``eta ** alpha``, k rows by
            ``eta ** (1 - alpha)`` with ``eta = threshold / max_logit``. Default 0.5.

    Collective: every rank of the weights' mesh (of the default group for plain tensors) must call
    it, with its own ``max_logits``; they are MAX-reduced first, so every rank scales alike. GQA: a
    key head shared by several query heads takes the smallest factor among them. Factors are
    float32; each weight element is multiplied once by its head's factor. The weights, ``head_dim``,
    ``threshold`` and ``alpha`` are checked on every rank before the collective; a ``max_logits`` of
    the wrong shape or dtype, or holding NaN or +inf, on any rank raises on every rank, with no
    weight changed. Momentum and other optimizer state are left as they are.
    """
    heads, kv_heads = _check(q_weight, k_weight, head_dim, threshold, alpha)
    s = _global_max(max_logits, q_weight, heads)
    q_factors, k_factors = qk_clip_factors(s, kv_heads, threshold=float(threshold), alpha=float(alpha))
    if bool((s > threshold).any()):  # else every factor is 1: nothing to write
        _scale_rows_(q_weight, q_factors, head_dim, "q_weight")
        _scale_rows_(k_weight, k_factors, head_dim, "k_weight")
    device = local_of(q_weight).device
    return QKClipFactors(q_factors.to(device), k_factors.to(device), s.to(device))
