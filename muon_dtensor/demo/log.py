"""The training log line people compare between runs: loss, tokens per second, the gradient norm,
each group's learning rate, what ``Muon.metrics()`` says, and peak memory. The demo and
``examples/train.py`` print it every N steps.

The gradient norm is the global one (over every shard of every gradient, before the step), computed
only on logging steps: ``grad_norm`` is one all-reduce per mesh there and nothing on the other steps,
so the step's hot path gains no collective. ``metrics()`` is this rank's and local.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["grad_norm", "learning_rates", "log_line", "peak_memory"]


def grad_norm(params: Iterable[Tensor]) -> float:
    """The 2-norm over every gradient of ``params``, whole (DTensor shards reduced over their mesh:
    collective on every rank of it). Call it after backward and before ``step``/``zero_grad``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads)
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def learning_rates(opt: torch.optim.Optimizer) -> str:
    """Each group's learning rate, named by its algorithm ("muon 0.02 adamw 0.003"); groups of one
    algorithm are numbered when there are several."""
    names = [str(g.get("algorithm", "group")) for g in opt.param_groups]
    shown = [f"{n}{names[:i].count(n)}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return " ".join(f"{n} {float(g['lr']):.3g}" for n, g in zip(shown, opt.param_groups))


def peak_memory(device: torch.device | str) -> str:
    """The device's peak allocated memory where it reports one (CUDA), else this process's peak
    resident set (the host's figure, from ``getrusage``)."""
    if torch.device(device).type == "cuda":
        return f"peak mem {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    mib = rss / 2**20 if sys.platform == "darwin" else rss / 2**10
    return f"peak RSS {mib:,.0f} MiB (host)"


def log_line(
    step: int,
    steps: int,
    loss: float,
    tokens_per_second: float,
    norm: float,
    opt: Any,
    device: torch.device | str,
) -> str:
    """``step 10/40 | loss 2.1234 | 12,345 tok/s | grad norm 0.812 | lr muon 0.02 adamw 0.003 |
    update rms 1.2e-03 | peak RSS 512 MiB (host)``; the update RMS is ``opt.metrics()``' (this rank's
    matrices), left out for an optimizer without ``metrics``."""
    parts = [f"step {step}/{steps}", f"loss {loss:.4f}", f"{tokens_per_second:,.0f} tok/s"]
    parts += [f"grad norm {norm:.4g}", f"lr {learning_rates(opt)}"]
    if hasattr(opt, "metrics"):
        parts.append(f"update rms {opt.metrics()['muon/update_rms']:.2e}")
    return " | ".join([*parts, peak_memory(device)])
