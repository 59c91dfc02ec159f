"""Session set-up: the pools of rank processes (tests/ranks.py) stop when the session ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import ranks


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    yield
    ranks.shutdown()
