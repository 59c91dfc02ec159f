"""Hugging Face-style safetensors in and out of sharded training.

- ``export_safetensors``: model weights of a DCP checkpoint folder to ``model.safetensors`` (or
  shards plus ``model.safetensors.index.json``), offline, in one process, no process group.
- ``load_safetensors``: fill a (sharded) model from such files; each rank reads only the rows and
  columns of its own block, so no rank materializes a full sharded matrix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._sharding.blocks import Block
from .._sharding.param_layout import layout_of, local_of
from ._warnings import single_process
from .manifest import CheckpointError

__all__ = ["export_safetensors", "load_safetensors"]

INDEX = "model.safetensors.index.json"


def _read_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{folder} holds no tensors under '{prefix}'")
    with single_process():  # "assuming the intent is to load in a single process": it is
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    return shards


def export_safetensors(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    prefix: str = "model.",
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write the ``prefix`` tensors of a DCP checkpoint folder as safetensors; returns the files.

    Names lose ``prefix`` (``model.layers.0.q.weight`` -> ``layers.0.q.weight``), so a checkpoint of a
    Hugging Face model exports under the names ``from_pretrained`` expects. With ``max_shard_bytes``
    the weights are split into ``model-0000i-of-0000n.safetensors`` plus an index file.
    """
    tensors = _read_tensors(Path(checkpoint), prefix)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        path = out / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2))
    return paths


def _file_of(folder: Path) -> dict[str, Path]:
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


@torch.no_grad()
def load_safetensors(model: nn.Module, folder: str | os.PathLike, *, strict: bool = True) -> None:
    """Copy weights from safetensors files into ``model``'s (possibly sharded) parameters."""
    files = _file_of(Path(folder))
    params = dict(model.named_parameters())
    missing, unexpected = params.keys() - files.keys(), files.keys() - params.keys()
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{folder}: missing {sorted(missing) or 'nothing'}, unexpected {sorted(unexpected) or 'nothing'}"
        )
    for name, p in params.items():
        if name not in files:
            continue
        with safe_open(str(files[name]), framework="pt") as f:
            piece = f.get_slice(name)
            shape = tuple(piece.get_shape())
            if shape != tuple(p.shape):
                raise CheckpointError(
                    f"{files[name]}: '{name}' has shape {shape}, the model {tuple(p.shape)}"
                )
            layout = layout_of(p, name)
            local_of(p).copy_(_read_block(piece, layout.blocks[layout.rank], shape))


def _read_block(piece: Any, block: Block, shape: tuple[int, ...]) -> torch.Tensor:
    """Read only ``block``'s rows and columns (one interval per dimension for Shard layouts)."""
    if not shape:
        return piece[:]
    if all(len(dim) == 1 for dim in block):
        return piece[tuple(slice(start, stop) for ((start, stop),) in block)]
    out = piece[:]  # interleaved pieces: read whole, then keep this block's indices
    for d, dim in enumerate(block):
        index = torch.cat([torch.arange(start, stop) for start, stop in dim])
        out = out.index_select(d, index)
    return out
