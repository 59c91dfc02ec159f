"""The optimizer's share of a training step, Muon against AdamW, from the cost model (pure arithmetic).

A step is forward and backward plus the optimizer step. Forward and backward take ``6 N T`` FLOPs
(N parameters, T tokens a step; Kaplan et al. 2020, arXiv 2001.08361) spread over G GPUs at a
model-flops utilization (``mfu``, an assumption: 40% by default) of the datasheet peak. AdamW reads
parameter, gradient and both moments and writes three of them in float32 (28 bytes per element) at
the hardware's memory bandwidth over the local shard of all N parameters, plus the host time of 2
ops per parameter tensor (torch's ``AdamW(foreach=True)`` on DTensors, ``bench_host.py``). Muon's
step is the cost model's prediction for the hidden matrices (``costmodel.predict(..., split=True)``)
plus AdamW on the rest. The optimizer's time is fixed per step and forward and backward grow with
T, so the share falls as tokens per step grow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .costmodel import predict
from .hardware import Hardware
from .plans import sharded_plan
from .shapes import LLAMA3_8B, LLAMA3_70B, Shape

__all__ = ["ADAMW_BYTES", "MFU", "MODELS", "PEAK_FLOPS", "StepShare", "flop_share", "step_share"]

# The H200's dense bf16 peak (NVIDIA product page); the utilization of it is an assumption.
PEAK_FLOPS, MFU = 989e12, 0.40
ADAMW_BYTES = 28  # float32: read parameter, gradient, exp_avg, exp_avg_sq; write three of them
# name -> (hidden matrix shapes, all parameters: Meta's Llama 3 releases, 8.03 B and 70.6 B)
MODELS: dict[str, tuple[list[Shape], float]] = {
    "llama3-8b": (LLAMA3_8B, 8.03e9),
    "llama3-70b": (LLAMA3_70B, 70.6e9),
}


@dataclass(frozen=True)
class StepShare:
    """One configuration's predicted step, in seconds, and the optimizer's share of it."""

    gpus: int
    tokens: float
    train_s: float  # forward and backward
    muon_s: float
    adamw_s: float

    @property
    def muon_share(self) -> float:
        return self.muon_s / (self.train_s + self.muon_s)

    @property
    def adamw_share(self) -> float:
        return self.adamw_s / (self.train_s + self.adamw_s)

    @property
    def step_ratio(self) -> float:
        """A whole Muon step over a whole AdamW step."""
        return (self.train_s + self.muon_s) / (self.train_s + self.adamw_s)


def step_share(
    shapes: Sequence[Shape],
    params: float,
    gpus: int,
    tokens: float,
    *,
    hw: Hardware | None = None,
    peak_flops: float = PEAK_FLOPS,
    mfu: float = MFU,
    tensors: int | None = None,
) -> StepShare:
    """Predict the step of a model with hidden matrices ``shapes`` and ``params`` parameters in all,
    FSDP over ``gpus`` GPUs, ``tokens`` tokens a step. ``tensors``: parameter tensors AdamW issues
    ops for (default: 9 per 7 hidden matrices, as a Llama block's q k v o gate up down and two
    norms, and 3 more). ValueError for a non-positive count or rate."""
    for name, value in (("params", params), ("gpus", gpus), ("tokens", tokens), ("peak_flops", peak_flops)):
        if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
            raise ValueError(f"step_share: {name} should be a positive number but is {value!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"step_share: mfu should be in (0, 1] but is {mfu!r}")
    hw = hw or Hardware.h200()
    hidden = sum(math.prod(s) for s in shapes)
    if hidden > params:
        raise ValueError(
            f"step_share: params {params:g} is fewer than the hidden matrices' {hidden:g} elements"
        )
    count = 9 * len(shapes) // 7 + 3 if tensors is None else tensors
    adamw = params / gpus * ADAMW_BYTES / hw.memory_bandwidth + 2 * count * hw.op_overhead
    rest = (params - hidden) / gpus * ADAMW_BYTES / hw.memory_bandwidth
    muon = predict(list(shapes), gpus, hw, split=True).total + rest
    train = 6 * params * tokens / (gpus * peak_flops * mfu)
    return StepShare(gpus=gpus, tokens=float(tokens), train_s=train, muon_s=muon, adamw_s=adamw)


def flop_share(shapes: Sequence[Shape], params: float, gpus: int, tokens: float, ns_steps: int = 5) -> float:
    """Newton-Schulz FLOPs of the busiest rank (owner mode, FSDP's ``Shard(0)`` plan) over those plus
    that rank's ``6 N T / G`` forward and backward FLOPs: Muon's share of a step where both run at
    one matmul rate and the elementwise work is negligible (a CPU, ``benchmarks/step_share.py measure``)."""
    if not (params > 0 and gpus > 0 and tokens > 0):
        raise ValueError(
            f"flop_share: params, gpus and tokens should be positive but are {params}, {gpus}, {tokens}"
        )
    ns = max(sharded_plan(list(shapes), gpus).loads) * ns_steps
    train = 6 * params * tokens / gpus
    return ns / (ns + train)
