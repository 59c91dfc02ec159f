"""Per-head max logits of the demo's ``TinyLM``, for QK-Clip (``MaxLogits.clip_``, ``qk_clip_all_``).

Its blocks call ``F.scaled_dot_product_attention``, which never exposes its scores, so the hooks
take the ``q`` and ``k`` projections' outputs (the exact tensors SDPA receives) and apply SDPA's
default scale ``1/sqrt(head_dim)`` and causal mask (``muon_dtensor.features.qk_logits.causal_max``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from muon_dtensor.features.qk_logits import MaxLogits, causal_max, head_ids, local_part

from .model import Block

__all__ = ["record_demo_logits"]


def _watch_demo_block(rec: MaxLogits, name: str, block: Any) -> None:
    """Hooks on a TinyLM block's ``q`` and ``k``: whichever runs second computes the scores."""
    head_dim = int(block.head_dim)
    seen: dict[str, Tensor] = {}

    def grab(part: str, module: Any) -> Callable[..., None]:
        def hook(_: nn.Module, inputs: Any, output: Tensor) -> None:
            out = local_part(output).detach()
            seen[part] = out.view(*out.shape[:-1], -1, head_dim).transpose(1, 2)
            if part == "q":
                seen["heads"] = head_ids(module.weight, out.shape[-1], head_dim, f"{name}.q.weight")
            if {"q", "k"} <= seen.keys():
                with torch.no_grad():
                    rec.update(name, seen["heads"], causal_max(seen["q"], seen["k"], head_dim**-0.5))
                seen.clear()

        return hook

    for part in ("q", "k"):
        module = getattr(block, part)
        rec.handles.append(module.register_forward_hook(grab(part, module)))


def record_demo_logits(model: nn.Module) -> MaxLogits:
    """Hooks on every ``Block`` of ``model``; ``values`` keyed by block name."""
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, Block)}
    rec = MaxLogits(
        {n: b.q.weight.shape[0] // b.head_dim for n, b in blocks.items()},
        {n: (b.q, b.k, int(b.head_dim)) for n, b in blocks.items()},
    )
    for name, block in blocks.items():
        _watch_demo_block(rec, name, block)
    return rec
