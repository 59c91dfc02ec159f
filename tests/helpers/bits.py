"""What a bit-for-bit assertion may compare (CONTRIBUTING.md, "Bits and tolerances"): two results of
the same kernels on the same shapes. A matrix's independence from its batch is checked so: the same
batch size and position, other batch-mates (a lone 2-D product against its row of a batched one, or
a batch against a part of it, would compare different kernels or shapes, which no torch release
promises to round alike)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def assert_batch_mates_do_not_matter(x: Tensor, run: Callable[[Tensor], Tensor], seed: int = 11) -> None:
    """Each matrix of the batch ``x`` gets the same bits from ``run`` when every other member of the
    batch is replaced (same count, same shapes, same position): batched against batched."""
    whole = run(x)
    others = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for i in range(x.shape[0]):
        mixed = others.to(x.dtype)
        mixed[i] = x[i]
        assert torch.equal(run(mixed)[i], whole[i]), f"matrix {i} of the batch changed with its batch-mates"
