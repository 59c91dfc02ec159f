"""Momentum buffers saved in another dtype than the optimizer keeps them (``Muon(momentum_dtype=...)``).

DCP reads each saved tensor into the optimizer's own state tensor with ``copy_``, which converts
between dtypes. For momentum buffers that conversion is wanted (an fp32 run resumed with bf16
momentum to save memory, or back), so it is allowed but said: a warning names the buffers, the
saved and the configured dtype, and the setting that keeps the saved one. Found from the
checkpoint's metadata before anything is read, so it is said before the load applies anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..base.warn import warn
from ._errors import CheckpointError

__all__ = ["converted_momentum", "refuse_int8_conversion", "warn_converted_momentum"]

_SUFFIX = ".momentum_buffer"


def converted_momentum(
    metadata: Metadata, flat_state: Mapping[str, Any], prefix: str
) -> list[tuple[str, str, str]]:
    """(parameter FQN, saved dtype, configured dtype) of every momentum buffer of ``flat_state``
    (DCP-flattened templates; optimizer state keys start with ``prefix``) that the checkpoint holds
    in another dtype."""
    out = []
    for key, wanted in flat_state.items():
        saved = metadata.state_dict_metadata.get(key)
        if not (key.startswith(prefix) and key.endswith(_SUFFIX) and isinstance(wanted, torch.Tensor)):
            continue
        if isinstance(saved, TensorStorageMetadata) and saved.properties.dtype != wanted.dtype:
            name = key[len(prefix) : -len(_SUFFIX)]
            out.append((name, _short(saved.properties.dtype), _short(wanted.dtype)))
    return out


def warn_converted_momentum(
    folder: Path, metadata: Metadata, flat_state: Mapping[str, Any], prefix: str
) -> None:
    """Warn, naming them, if momentum buffers will be converted as they load."""
    converted = converted_momentum(metadata, flat_state, prefix)
    if not converted:
        return
    shown = ", ".join(f"'{n}' {a} -> {b}" for n, a, b in converted[:8])
    more = f" and {len(converted) - 8} more" if len(converted) > 8 else ""
    warn(
        f"{folder}: momentum buffers saved in another dtype than this optimizer's momentum_dtype are "
        f"converted as they load (a narrower dtype rounds each value once; a wider one is exact): "
        f"{shown}{more}. To keep them as saved, build Muon with momentum_dtype=torch.{converted[0][1]} "
        "for their group",
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refuse_int8_conversion(
    folder: Path, metadata: Metadata, flat_state: Mapping[str, Any], prefix: str
) -> None:
    """8-bit momentum (int8 blocks beside their float32 maxima) converts to and from a float dtype
    in memory only: DCP's ``copy_`` would read the int8 values as momentum. Raise, naming the
    buffers and the way on, before anything is read."""
    pairs = [(n, a, b) for n, a, b in converted_momentum(metadata, flat_state, prefix) if "int8" in (a, b)]
    if not pairs:
        return
    shown = ", ".join(f"'{n}' {a} -> {b}" for n, a, b in pairs[:8])
    more = f" and {len(pairs) - 8} more" if len(pairs) > 8 else ""
    raise CheckpointError(
        f"{folder}: momentum buffers saved in another momentum_dtype, one of them 8-bit (int8 blocks "
        f"and their maxima), cannot be converted as they load: {shown}{more}. Nothing was loaded. "
        f"Load with momentum_dtype=torch.{pairs[0][1]} for their group, then set the group's "
        f"'momentum_dtype' to {pairs[0][2]!r}: the next step converts the buffers in memory"
    )
