"""The hidden matrices of transformer models, as the cost model and the planning CLI count them."""

from __future__ import annotations

__all__ = ["LLAMA3_8B", "LLAMA3_70B", "LLAMA31_405B", "Shape", "transformer_shapes"]

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
