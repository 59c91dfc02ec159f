"""The memo pattern of the package, in one place: a value per object, found by the object's identity
in O(1) (a 8,192-rank blocks tuple is never hashed), never kept past its object and never handed to
another object that later takes its id.

An object that takes a weak reference (a ``DeviceMesh``, a ``ProcessGroup``, a ``Plan``) is held
weakly: its entry goes when the object does, so a cache never keeps a mesh or its process groups
alive. A tuple takes none; its entry holds it (so its id stays its own), which keeps only integers
alive, and the memo is cleared when it reaches ``limit`` entries."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["WeakMemo"]

V = TypeVar("V")


class WeakMemo(Generic[V]):
    """``memo.get(obj)`` -> the value stored for this very object, or None; ``memo.put(obj, v)``."""

    def __init__(self, limit: int = 4096) -> None:
        self._entries: dict[int, tuple[object, V]] = {}
        self._limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: object) -> V | None:
        hit = self._entries.get(id(key))
        if hit is None:
            return None
        held = hit[0]  # the key itself (a tuple), or a weak reference to it
        return hit[1] if held is key or (type(held) is weakref.ref and held() is key) else None

    def put(self, key: object, value: V) -> V:
        if len(self._entries) >= self._limit:
            self._entries.clear()
        slot = id(key)
        entries = self._entries
        try:
            held: object = weakref.ref(key, _dropper(entries, slot))
        except TypeError:  # a tuple: held, so its id cannot pass to another object
            held = key
        entries[slot] = (held, value)
        return value

    def clear(self) -> None:
        self._entries.clear()


def _dropper(entries: dict[int, Any], slot: int) -> Callable[[object], None]:
    """The callback of a weakly held key: drop its entry, unless the slot already holds a later
    object's. It looks up no global, so it runs at interpreter exit too (globals are None then)."""

    def drop(ref: object) -> None:
        hit = entries.get(slot)
        if hit is not None and hit[0] is ref:
            del entries[slot]

    return drop
