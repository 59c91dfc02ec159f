"""Pure results computed once per equal arguments: the cost model's predictions and split plans are
arithmetic over the plan, and a 1,024-rank one takes seconds, so equal hashable arguments share one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["once"]

T = TypeVar("T")


def once(cached: Callable[..., T], plain: Callable[..., T], args: tuple[Any, ...]) -> T:
    """``cached(*args)`` (an ``lru_cache`` of ``plain``) where every argument hashes, else ``plain(*args)``."""
    try:
        hash(args)
    except TypeError:  # an unhashable argument: no cache, the same arithmetic
        return plain(*args)
    return cached(*args)
