"""Record each attention layer's largest pre-softmax logit per head: the input of ``qk_clip_``.

Forward hooks recompute the scores ``q k^T * scale`` (mask included) from the layer's own q and k,
under ``no_grad``, and keep a running max per query head (``MaxLogits``; ``head_ids`` and
``causal_max`` serve recorders of other models, such as the demo's in ``demo/logits.py``).

Hugging Face's ``LlamaForCausalLM`` with ``attn_implementation="eager"``
(``record_llama_logits``): the hook repeats eager attention's own ops on the layer's inputs (q/k
  projections, rotary embedding, ``repeat_kv``, ``matmul * scaling + attention_mask``), so it sees
  the tensor eager's softmax sees. Keys from a generation cache (earlier tokens) are not included.

This costs one more score computation per layer and forward: meant for small models, tests and
monitoring. At scale the max belongs inside the attention kernel (Megatron-LM reads it from
Transformer Engine's attention, MagiAttention's FFA returns it).

Under tensor parallelism a rank computes only its heads: the hooks find which from the local rows of
the projection weight (``qk_clip.local_rows``), and the others stay ``-inf``, as ``qk_clip_`` expects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from .qk_clip import QKClipFactors, local_rows, qk_clip_all_

__all__ = ["MaxLogits", "causal_max", "head_ids", "local_part", "record_llama_logits"]


class MaxLogits:
    """Per-head running max of the pre-softmax logits of some attention layers, fed by forward hooks.

    ``values[name]`` is a float32 ``[num_heads]`` tensor for the layer (module) ``name``: the largest
    logit each query head produced since the last ``reset()``; ``-inf`` for heads this rank did not
    compute. ``projections[name]``, where known, is the layer's (q projection, k projection,
    head_dim), for ``clip_``. Use as a context manager, or call ``remove()`` to take the hooks off.
    """

    def __init__(
        self, heads: dict[str, int], projections: dict[str, tuple[nn.Linear, nn.Linear, int]] | None = None
    ) -> None:
        self.heads = dict(heads)
        self.projections = dict(projections or {})
        self.values: dict[str, Tensor] = {}
        self.handles: list[RemovableHandle] = []
        self.reset()

    def reset(self) -> None:
        """Start a new step: every head back to ``-inf``."""
        self.values = {name: torch.full((n,), -math.inf) for name, n in self.heads.items()}

    def largest(self) -> float:
        """The largest value recorded on this rank over every layer and head (``-inf`` if none)."""
        return max((float(v.max()) for v in self.values.values() if v.numel()), default=-math.inf)

    def clip_(
        self, *, threshold: float = 100.0, alpha: float = 0.5, values: dict[str, Tensor] | None = None
    ) -> dict[str, QKClipFactors]:
        """QK-Clip every layer in ``projections`` with ``values`` (default: this recorder's), by
        ``qk_clip_all_``: one MAX all-reduce per mesh axis for all layers (one call per distinct
        head_dim). Collective, like ``qk_clip_all_``; returns each layer's factors by name."""
        values = self.values if values is None else values
        out: dict[str, QKClipFactors] = {}
        for head_dim in sorted({d for _, _, d in self.projections.values()}):
            layers = {
                # a missing entry is None: qk_clip_all_ then raises on every rank
                n: (q.weight, k.weight, cast(Tensor, values.get(n)))
                for n, (q, k, d) in self.projections.items()
                if d == head_dim
            }
            out.update(zip(layers, qk_clip_all_(layers, head_dim=head_dim, threshold=threshold, alpha=alpha)))
        return {n: out[n] for n in self.projections}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def __enter__(self) -> MaxLogits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def update(self, name: str, heads: Tensor, local_max: Tensor) -> None:
        """Fold the max of query heads ``heads`` (global indices) into ``values[name]``."""
        current = self.values[name].to(local_max.device)
        index = heads.to(local_max.device)
        current[index] = torch.maximum(current[index], local_max.detach().float())
        self.values[name] = current


def head_ids(weight: Tensor, width: int, head_dim: int, name: str) -> Tensor:
    """Global indices of the heads a projection output of ``width`` features holds, in order."""
    rows = local_rows(weight, name) if isinstance(weight, DTensor) else torch.arange(weight.shape[0])
    heads = rows[::head_dim] // head_dim
    whole = (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
    if rows.numel() != width or not torch.equal(rows, whole):
        raise ValueError(
            f"{name}: the output holds {width} features but the weight's local rows are not whole heads of "
            f"head_dim={head_dim} ({rows.numel()} rows); record logits where each rank computes whole heads "
            "with the weight gathered (FSDP2 forward) or split by heads (colwise tensor parallel)"
        )
    return heads


def causal_max(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Per-head max of ``q k^T * scale`` over batch, query and causally visible key positions.
    ``q``, ``k``: ``[batch, heads, seq, head_dim]``."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    t, s = scores.shape[-2:]
    hidden = torch.ones(t, s, dtype=torch.bool, device=scores.device).triu(s - t + 1)
    return scores.masked_fill(hidden, -math.inf).amax(dim=(0, 2, 3))


def local_part(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _llama_hook(rec: MaxLogits, name: str) -> Callable[..., None]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    @torch.no_grad()
    def hook(attn: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        mask = kwargs.get("attention_mask")
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        q = local_part(attn.q_proj(hidden)).view(shape).transpose(1, 2)
        k = local_part(attn.k_proj(hidden)).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        scores = torch.matmul(q, repeat_kv(k, attn.num_key_value_groups).transpose(2, 3)) * attn.scaling
        if mask is not None:  # as eager_attention_forward adds it (a boolean mask: True = attend)
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
        heads = head_ids(
            attn.q_proj.weight, q.shape[1] * attn.head_dim, attn.head_dim, f"{name}.q_proj.weight"
        )
        rec.update(name, heads, scores.amax(dim=(0, 2, 3)))

    return hook


def record_llama_logits(model: nn.Module) -> MaxLogits:
    """Hooks on every ``LlamaAttention`` of a Hugging Face Llama loaded with
    ``attn_implementation="eager"``; ``values`` keyed by attention module name."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != "eager":
        raise ValueError(
            f"record_llama_logits repeats eager attention's ops, but the model's attention is {impl!r}; "
            'load it with attn_implementation="eager" (or call model.set_attn_implementation("eager"))'
        )
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LlamaAttention)}
    rec = MaxLogits(
        {n: m.q_proj.weight.shape[0] // m.head_dim for n, m in layers.items()},
        {n: (m.q_proj, m.k_proj, int(m.head_dim)) for n, m in layers.items()},
    )
    for name, attn in layers.items():
        # prepend: run before a fully_shard post-forward hook on the module reshards its weights
        rec.handles.append(attn.register_forward_hook(_llama_hook(rec, name), with_kwargs=True, prepend=True))
    return rec
