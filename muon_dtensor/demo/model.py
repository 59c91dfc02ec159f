"""A small decoder-only transformer language model for the demo and examples (no downloads).

The attention projections are separate ``q``, ``k``, ``v`` matrices (not one fused ``qkv``): Muon
orthogonalizes each matrix as a whole, and separate projections are what Keller Jordan's recipe uses.
They also let tensor parallelism shard heads with ``ColwiseParallel`` (see ``parallel.py``): the
forward pass takes the number of local heads from the local width, so it runs unchanged on a
tensor-parallel shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Block", "ModelConfig", "TinyLM"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 32
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(
                f"dim should be a multiple of heads but dim is {self.dim} and heads {self.heads}"
            )


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        # -1: the heads held here (all of them, or this tensor-parallel rank's share)
        q, k, v = (z(h).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of a batch ``[B, seq + 1]``."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
