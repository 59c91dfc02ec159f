"""A corpus generated deterministically from a seed: sentences from a tiny grammar, byte-level tokens.

No file and no download: every rank and every run sees the same text, and the structure (agreement,
fixed phrases) gives a language model something to learn in a few dozen steps.
"""

from __future__ import annotations

import torch

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "one bird", "the teacher"]
_VERBS = ["sees", "likes", "finds", "carries", "draws", "hears"]
_OBJECTS = ["a red ball", "the small house", "two apples", "the river", "a long song", "the moon"]
_ENDINGS = [" today.", " again.", " at night.", " slowly.", "."]


def corpus(chars: int = 200_000, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    parts: list[str] = []
    total = 0
    while total < chars:
        pick = torch.randint(0, 1_000_000, (4,), generator=gen).tolist()
        words = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)
        sentence = " ".join(w[i % len(w)] for w, i in zip(words[:3], pick[:3])) + _ENDINGS[pick[3] % 5]
        parts.append(sentence + " ")
        total += len(sentence) + 1
    return "".join(parts)[:chars]


def tokens(text: str, vocab: int = 64) -> torch.Tensor:
    """Map characters to ids below ``vocab`` (the corpus uses fewer than 40 distinct characters)."""
    alphabet = sorted(set(text))
    if len(alphabet) > vocab:
        raise ValueError(f"corpus has {len(alphabet)} characters but vocab is {vocab}")
    index = {c: i for i, c in enumerate(alphabet)}
    return torch.tensor([index[c] for c in text], dtype=torch.long)


def batch(data: torch.Tensor, step: int, batch_size: int, seq: int) -> torch.Tensor:
    """The global batch of ``step``: the same on every rank, split by rank by the caller."""
    gen = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
