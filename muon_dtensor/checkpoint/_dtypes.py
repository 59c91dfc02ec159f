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

from ..checks.warn import warn

__all__ = ["converted_momentum", "warn_converted_momentum"]

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
