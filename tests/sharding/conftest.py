"""Fixtures of the sharding tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

RANK, WORLD = 5, 16  # the rank ``fake_world`` plays, and its world


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank ``RANK`` of a fake world of ``WORLD`` ranks as the default group, destroyed after."""
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()
