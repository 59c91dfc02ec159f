"""Session set-up: the pools of rank processes (tests/ranks.py) stop when the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests import ranks


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    yield
    ranks.shutdown()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One BLAS thread for the test: with several, MKL may split a lone product's work another way
    than a batch's (bits of float64 products then depend on the batch on Intel hosts), so batch
    independence is claimed, and checked, for one thread (docs/api.md, ``newton_schulz``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
