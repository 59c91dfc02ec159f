"""A corpus generated deterministically from a seed: sentences from a tiny grammar, byte-level tokens.

No file and no download: every rank and every run sees the same text, and the structure (agreement,
fixed phrases) gives a language model something to learn in a few dozen steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["batch", "corpus", "file_tokens", "micro_batches", "tokens"]

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
        sentence = (
            " ".join(w[i % len(w)] for w, i in zip(words[:3], pick[:3], strict=True)) + _ENDINGS[pick[3] % 5]
        )
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


def file_tokens(path: str | Path) -> torch.Tensor:
    """A file's bytes as tokens (vocabulary 256): any text file trains with no tokenizer."""
    raw = Path(path).read_bytes()
    if len(raw) < 2:
        raise ValueError(f"{path} should hold at least 2 bytes but holds {len(raw)}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def batch(data: torch.Tensor, step: int, batch_size: int, seq: int) -> torch.Tensor:
    """The global batch of ``step``: the same on every rank, split by rank by the caller."""
    if data.numel() < seq + 2:
        raise ValueError(f"the data holds {data.numel()} tokens, fewer than a sequence of {seq} + 2")
    gen = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch_size,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def micro_batches(data: torch.Tensor, step: int, count: int, size: int, seq: int) -> list[torch.Tensor]:
    """The global batch of ``step`` as ``count`` micro-batches of ``size`` sequences.

    A run that splits its batch into the same micro-batches on any number of ranks computes the same
    per-micro-batch gradients, which is what lets a resumed run on another world size stay exact.
    """
    return list(batch(data, step, count * size, seq).split(size))
