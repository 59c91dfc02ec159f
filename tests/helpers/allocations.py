"""Tensor-byte accounting during a block of code: every storage an operator creates is counted from
its creation until it is freed (a weak reference's callback), and the peak of the live total kept.
A measurement for ``Muon.memory()``'s predicted peak, independent of its arithmetic."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...``; then ``m.peak``: the most bytes of storages created inside
    the block alive at once (storages that existed before do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def _track(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(storage)
        if key in self._seen and self._seen[key]() is not None:
            return
        nbytes = storage.nbytes()

        def freed(_: Any, key: int = key, nbytes: int = nbytes) -> None:
            self.live -= nbytes
            self._seen.pop(key, None)

        self._seen[key] = weakref.ref(storage, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # an output on an input's storage (a view, an in-place op) allocated nothing
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _ptr(t) not in inputs:
                self._track(t)
        return out


def _ptr(t: torch.Tensor) -> int | None:
    if type(t) is not torch.Tensor or t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else id(storage)
