"""The hidden matrices of transformer models, as the cost model and the planning CLI count them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEEPSEEK_V3",
    "KIMI_K2",
    "LLAMA3_8B",
    "LLAMA3_70B",
    "LLAMA31_405B",
    "MoEModel",
    "Shape",
    "deepseek_v3_like",
    "mla_shapes",
    "transformer_shapes",
]

Shape = tuple[int, int]


def transformer_shapes(
    layers: int,
    dim: int,
    *,
    kv_rows: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    fused_qkv: bool = False,
) -> list[Shape]:
    """Hidden matrices (rows x cols = out x in, as ``nn.Linear.weight``) of ``layers`` layers, in
    order q, k, v, o (or fused qkv, o), then MLP up (gate, up when ``gated``) and down."""
    kv = dim if kv_rows is None else kv_rows
    hidden = 4 * dim if ffn is None else ffn
    attn = [(dim + 2 * kv, dim), (dim, dim)] if fused_qkv else [(dim, dim), (kv, dim), (kv, dim), (dim, dim)]
    mlp = [(hidden, dim)] * (2 if gated else 1) + [(dim, hidden)]
    return (attn + mlp) * layers


# Meta's params.json: Llama-3-8B dim 4096, 8 kv heads x 128 = 1024 rows, ffn 14336, 32 layers;
# Llama-3-70B dim 8192, 8 kv heads x 128, ffn 28672, 80 layers.
LLAMA3_8B = transformer_shapes(32, 4096, kv_rows=1024, ffn=14336, gated=True)
LLAMA3_70B = transformer_shapes(80, 8192, kv_rows=1024, ffn=28672, gated=True)
# Llama-3.1-405B (Meta's params.json): dim 16384, 8 kv heads x 128, ffn 53248, 126 layers.
LLAMA31_405B = transformer_shapes(126, 16384, kv_rows=1024, ffn=53248, gated=True)


@dataclass(frozen=True)
class MoEModel:
    """A mixture-of-experts model as Muon sees it: ``dense`` matrices (attention, dense MLPs, shared
    experts, routers: 2-D weights FSDP2 shards by rows), and per MoE layer ``experts`` routed experts
    in each of the ``stacks`` (one [E, rows, cols] parameter each, ``"experts": True``)."""

    name: str
    dense: tuple[Shape, ...]
    experts: int
    stacks: tuple[Shape, ...]
    moe_layers: int

    @property
    def expert_matrices(self) -> int:
        return self.experts * len(self.stacks) * self.moe_layers

    def expert_shapes(self, count: int) -> list[Shape]:
        """The matrices of ``count`` experts of every stack of every MoE layer (what one rank, or
        one expert-parallel group, holds), in the order of the parameters."""
        return [s for _ in range(self.moe_layers) for s in self.stacks for _ in range(count)]

    def expert_elements(self) -> int:
        return self.experts * self.moe_layers * sum(r * c for r, c in self.stacks)


def mla_shapes(dim: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int) -> list[Shape]:
    """Multi-head latent attention's matrices (DeepSeek-V2/V3's ``modeling_deepseek.py``): q_a, q_b,
    kv_a (with the shared rope key), kv_b, o."""
    return [
        (q_rank, dim),
        (heads * (nope + rope), q_rank),
        (kv_rank + rope, dim),
        (heads * (nope + v), kv_rank),
        (dim, heads * v),
    ]


def deepseek_v3_like(name: str, heads: int, experts: int, dense_layers: int) -> MoEModel:
    """DeepSeek-V3's architecture: 61 layers of width 7168, MLA (q_lora_rank 1536, kv_lora_rank 512,
    qk_nope 128, qk_rope 64, v 128), the first ``dense_layers`` with a gated MLP of 18432, the rest
    with a router, one shared expert and ``experts`` routed experts of hidden 2048 (gated: w1, w3
    [E, 2048, 7168], w2 [E, 7168, 2048], as torchtitan's grouped experts). Embedding, output and the
    multi-token-prediction layer are not Muon matrices here (as for the Llama presets)."""
    dim, layers, ffn, hidden = 7168, 61, 18432, 2048
    attn = mla_shapes(dim, heads, 1536, 512, 128, 64, 128)
    gated = [(hidden, dim), (hidden, dim), (dim, hidden)]
    dense = (attn + [(ffn, dim), (ffn, dim), (dim, ffn)]) * dense_layers
    moe = (attn + [(experts, dim)] + gated) * (layers - dense_layers)  # router, shared expert
    return MoEModel(name, tuple(dense + moe), experts, tuple(gated), layers - dense_layers)


# Hugging Face config.json of deepseek-ai/DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/
# config.json): hidden_size 7168, num_hidden_layers 61, intermediate_size 18432, moe_intermediate_size
# 2048, n_routed_experts 256, n_shared_experts 1, first_k_dense_replace 3, num_attention_heads 128,
# q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128.
DEEPSEEK_V3 = deepseek_v3_like("deepseek-v3", heads=128, experts=256, dense_layers=3)
# moonshotai/Kimi-K2-Instruct's config.json (huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/
# config.json, model_type kimi_k2 on DeepSeek-V3's code): the same widths, num_attention_heads 64,
# n_routed_experts 384, first_k_dense_replace 1 (the figures agree with the copies of that file the
# code index holds; the file itself was not in it).
KIMI_K2 = deepseek_v3_like("kimi-k2", heads=64, experts=384, dense_layers=1)
