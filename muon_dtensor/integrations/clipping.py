"""Gradient clipping by the global norm over every pipeline stage's parameters (docs/torchtitan.md).

``torch.nn.utils.clip_grad_norm_`` over the merged model stacks one norm per gradient, in parameter
order, and takes the norm of that stack. The usual pipeline recipe (torchtitan's) takes each stage's
norm and then the norm of the stages' norms: the same value in exact arithmetic, other rounding. Here
each stage computes the same per-gradient norms, the stages gather them in stage order (the pp group's
rank order), and every stage takes the norm of the one stack: bitwise the merged model's, wherever the
merged model's parameter order is the stages' in turn (stages cut by FQN prefixes in module order).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.torch_ops import foreach_mul_, foreach_norm
from ..checks.together import attempt, raise_together
from ..sharding.plan.param_layout import local_of
from ..sharding.runtime.comm import gather_objects

__all__ = ["clip_grad_norm_stages_"]


def clip_grad_norm_stages_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Scale this stage's gradients by ``min(max_norm / (total + 1e-6), 1)``, as
    ``torch.nn.utils.clip_grad_norm_`` does, where ``total`` is the ``norm_type`` norm over every
    stage's gradients; returns ``total`` (the same on every rank). ``group``: the pipeline ("pp")
    group, this rank's stage and one rank of each other stage, in stage order (None: the default
    group; one rank: a merged model). Collective over ``group``: every rank calls it, and ranks that
    pass another ``max_norm`` or ``norm_type`` get a ValueError on every rank (agreed over the default
    group: every rank of the job calls it, as a pipeline's ranks all clip each step).

    Exact: a stage's gradients of one dtype give the bits of ``clip_grad_norm_`` over the merged
    model on one process. FSDP2 gradients (DTensors) inside a stage: each gradient's norm is reduced
    over its mesh first (one all-reduce per stage), so the result equals this function over the
    merged model on the same dp ranks, and torch's clip within rounding (it reduces per rank first).
    ``norm_type=inf`` over a DTensor with an empty shard raises on every rank, as torch's clip fails."""
    params = [p for p in parameters if p.grad is not None]
    grads: list[Any] = [p.grad for p in params]
    norms, error = attempt(lambda: _norms(grads, max_norm, norm_type))  # local: no collective yet
    arguments = {"max_norm": max_norm, "norm_type": norm_type}
    raise_together(error, None, "clip_grad_norm_stages_", arguments, "No gradient was changed")
    assert norms is not None
    mine = (norms.full_tensor() if isinstance(norms, DTensor) else norms).cpu()  # over dp: a Partial norm
    total = torch.linalg.vector_norm(torch.cat(gather_objects(mine, group)), float(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's _clip_grads_with_norm_
    local = [local_of(g) for g in grads]
    if local:
        foreach_mul_(local, coef.to(local[0].device))
    return total


def _norms(grads: list[Tensor], max_norm: float, norm_type: float) -> Tensor:
    """One norm per gradient, in order, as a 1-D tensor (for DTensors, still partial over the mesh)."""
    _check(grads, max_norm, norm_type)
    if not grads:
        return torch.zeros(0)
    try:
        return torch.stack(foreach_norm(grads, float(norm_type)))
    except RuntimeError as e:  # an empty shard has no infinity norm
        raise ValueError(f"norm_type={norm_type} over these gradients failed on this rank ({e})") from e


def _check(grads: list[Tensor], max_norm: float, norm_type: float) -> None:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm should be a positive number but is: {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type should be a positive number or inf but is: {norm_type!r}")
    kinds = {(g.dtype, g.device.type) for g in grads}
    if len(kinds) > 1:
        raise ValueError(
            f"the gradients should share one dtype and device but are {sorted(map(str, kinds))}: "
            "clip_grad_norm_ orders its norms by (device, dtype), so the stages' stack would not be "
            "the merged model's; clip each kind separately"
        )
