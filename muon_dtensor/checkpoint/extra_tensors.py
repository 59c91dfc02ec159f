"""Tensors in a checkpoint's ``extra``: RNG states (``torch.get_rng_state()``) and any other plain
tensor a loop keeps beside the model. The manifest holds a placeholder per tensor (its index, shape
and dtype); the values are DCP entries that each rank writes for itself (``extra.rank<r>.t<i>``), since
ranks often hold other RNG states. A load gives every rank its own rank's values, or rank 0's where
the saving run had fewer ranks; it reads them as tensor data through the checkpoint's safe reader,
so the trust boundary holds: nothing in a checkpoint runs code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["PLACEHOLDER", "fill", "is_extra_tensor", "rank_entries", "split_tensors", "templates"]

PLACEHOLDER = "__tensor__"  # a manifest dict with this key stands for a tensor; users' dicts may not use it
_MAX_ELEMENTS = 1 << 26  # per tensor: extra is for small state (an RNG state is a few KiB), not weights


def is_extra_tensor(value: Any, where: str) -> bool:
    """Whether ``value`` is a tensor ``extra`` can hold; ValueError naming ``where`` for one it cannot."""
    if not isinstance(value, Tensor):
        return False
    if isinstance(value, DTensor) or value.is_sparse or value.device.type == "meta":
        raise ValueError(
            f"{where} is a {type(value).__name__} on {value.device}: extra holds plain dense tensors (an RNG "
            "state, a counter); save sharded tensors as model or optimizer state"
        )
    if value.numel() > _MAX_ELEMENTS:
        raise ValueError(
            f"{where} has {value.numel():,} elements, above extra's {_MAX_ELEMENTS:,}: save it as state"
        )
    return True


def split_tensors(extra: Any, tensors: list[Tensor] | None = None) -> tuple[Any, list[Tensor]]:
    """``extra`` with each tensor replaced by its placeholder, and the tensors in placeholder order
    (detached host copies: an async save publishes later)."""
    tensors = [] if tensors is None else tensors
    if isinstance(extra, Tensor):
        tensors.append(extra.detach().to("cpu", copy=True))
        return {
            PLACEHOLDER: len(tensors) - 1,
            "shape": list(extra.shape),
            "dtype": _name(extra.dtype),
        }, tensors
    if isinstance(extra, dict):
        return {k: split_tensors(v, tensors)[0] for k, v in extra.items()}, tensors
    if isinstance(extra, list):
        return [split_tensors(v, tensors)[0] for v in extra], tensors
    return extra, tensors


def rank_entries(tensors: list[Tensor], rank: int) -> dict[str, Any]:
    """What this rank adds to the state DCP writes."""
    return {"extra": {f"rank{rank}": {f"t{i}": t for i, t in enumerate(tensors)}}} if tensors else {}


def templates(extra: Any, rank: int, saved_world: int) -> dict[str, Any]:
    """The state to read this rank's tensors into: its own rank's, or rank 0's past the saved ranks."""
    found: dict[str, Tensor] = {}
    _walk(extra, lambda p: found.__setitem__(f"t{p[PLACEHOLDER]}", torch.empty(_shape(p), dtype=_dtype(p))))
    source = rank if rank < saved_world else 0
    return {"extra": {f"rank{source}": found}} if found else {}


def fill(extra: Any, loaded: dict[str, Any]) -> Any:
    """``extra`` from the manifest with each placeholder replaced by its loaded tensor."""
    (values,) = loaded["extra"].values() if loaded.get("extra") else ({},)
    if isinstance(extra, dict) and PLACEHOLDER in extra:
        return values[f"t{extra[PLACEHOLDER]}"]
    if isinstance(extra, dict):
        return {k: fill(v, loaded) for k, v in extra.items()}
    if isinstance(extra, list):
        return [fill(v, loaded) for v in extra]
    return extra


def _walk(extra: Any, visit: Callable[[dict[str, Any]], None]) -> None:
    if isinstance(extra, dict) and PLACEHOLDER in extra:
        visit(extra)
    elif isinstance(extra, dict):
        for v in extra.values():
            _walk(v, visit)
    elif isinstance(extra, list):
        for v in extra:
            _walk(v, visit)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(placeholder: dict[str, Any]) -> torch.dtype:
    """The placeholder's dtype, looked up among torch's dtypes only (the manifest is data)."""
    found = getattr(torch, str(placeholder.get("dtype")), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"extra: a tensor's dtype {placeholder.get('dtype')!r} is not a torch dtype")
    return found


def _shape(placeholder: dict[str, Any]) -> list[int]:
    shape = placeholder.get("shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"extra: a tensor's shape {shape!r} is not a list of sizes")
    return shape
