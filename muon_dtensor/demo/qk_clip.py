"""The demo's ``--qk-clip``: QK-Clip after every optimizer step, with the largest logit before and after.

After each step every block's q and k weights go through ``muon_dtensor.qk_clip_all_`` (one MAX
all-reduce per mesh axis for all blocks) with the step's per-head max logits
(``demo/logits.record_demo_logits``). For the report the same
micro-batches run forward twice more, without gradients: with the updated weights before and after
clipping. Both optimizers' runs clip alike, so each is still compared with its own uninterrupted twin.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from muon_dtensor.sharding.runtime import comm

from .logits import record_demo_logits

__all__ = ["DEFAULT_THRESHOLD", "StepClip", "describe", "same_after_resume", "table"]

# The demo model's largest logit grows from about 1 to about 8 over its 40 steps (Muon, lr 0.02), so a
# threshold of 5 clips the second half of the run. Kimi K2 used 100 on a 1T-parameter model.
DEFAULT_THRESHOLD = 5.0


class StepClip:
    """QK-Clip for one rank's model: ``start()`` before a step's forward passes, ``finish()`` after
    the optimizer step. Collective (``qk_clip_all_`` and one MAX per measuring pass)."""

    def __init__(self, model: nn.Module, threshold: float) -> None:
        self.model, self.threshold = model, threshold
        self.logits = record_demo_logits(model)

    def start(self) -> None:
        self.logits.reset()

    def finish(self, batches: list[torch.Tensor]) -> tuple[float, float, float, int]:
        """Clip every block with the step's logits. Returns, the same on every rank: the largest
        logit of the step's forward passes (what QK-Clip reads), the largest on the same batches with
        the updated weights before clipping and after clipping, and the number of heads clipped."""
        read = {name: v.clone() for name, v in self.logits.values.items()}
        before = self._measure(batches)
        done = self.logits.clip_(threshold=self.threshold, values=read).values()
        largest = max((float(d.max_logits.max()) for d in done), default=-math.inf)
        clipped = sum(int((d.max_logits > self.threshold).sum()) for d in done)
        return largest, before, self._measure(batches), clipped

    @torch.no_grad()
    def _measure(self, batches: list[torch.Tensor]) -> float:
        """The largest logit of a forward pass over ``batches``, MAX over every rank."""
        self.logits.reset()
        for tokens in batches:
            self.model(tokens[:, :-1])
        if isinstance(self.model, FSDPModule):
            # A forward without backward leaves the root's parameters gathered; shard them again so
            # nothing later reads a stale gathered copy.
            self.model.reshard()
        local = torch.tensor([self.logits.largest()])
        return float(comm.max_over_group(local, None)[0])


def describe(threshold: float) -> str:
    return (
        f"QK-Clip (--qk-clip {threshold:g}, muon_dtensor.qk_clip_all_, Kimi K2's MuonClip): after every optimizer step, "
        "each attention head whose largest\nlogit q.k/sqrt(head_dim) in the step's forward passes (MAX over "
        f"all ranks) exceeds {threshold:g} has its q and k rows scaled by sqrt({threshold:g}/logit) each.\n"
        "The last two columns are extra forward passes over the step's batch with the updated weights, before "
        "and after clipping\n(clipping reads the step's own forward, before the update, so the clipped logit "
        f"can still be a little above {threshold:g})."
    )


def table(records: dict[int, tuple[float, float, float, int]], heads: int, most: int = 10) -> str:
    """One row per shown step: the largest logit QK-Clip read, heads clipped, and the largest logit
    with the updated weights before and after clipping."""
    steps = sorted(records)
    stride = max(1, -(-len(steps) // most))
    shown = sorted(set(steps[::stride]) | {steps[-1]})
    lines = [
        f"| step | largest logit, step's forward | heads clipped (of {heads}) "
        "| largest logit, updated weights: before clipping | after clipping |",
        "|---:|---:|---:|---:|---:|",
    ]
    for step in shown:
        read, before, after, clipped = records[step]
        lines.append(f"| {step} | {read:.3f} | {clipped} | {before:.3f} | {after:.3f} |")
    return "\n".join(lines)


def same_after_resume(straight: dict[str, Any], resumed: dict[str, Any]) -> bool:
    """Whether the resumed run clipped exactly as its twin at every step both ran."""
    ours, twin = resumed.get("qk_clip", {}), straight.get("qk_clip", {})
    return bool(ours) and all(twin.get(step) == record for step, record in ours.items())
