"""Hugging Face-style safetensors in and out of sharded training.

- ``export_safetensors``: model weights of a DCP checkpoint folder to ``model.safetensors`` (or
  shards plus ``model.safetensors.index.json``), offline, in one process, no process group.
- ``load_safetensors``: fill a (sharded) model from such files (``save_pretrained``'s too); each rank
  reads only the rows and columns of its own block, so no rank materializes a full sharded matrix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ..base.torch_dist import non_persistent_buffers
from ..optim.group_sharding import layout_of
from ..sharding.plan.blocks import Block
from ..sharding.plan.param_layout import local_of
from ._warnings import single_process
from .arguments_agree import agree
from .keys import format_of_manifest
from .manifest import CheckpointError, verify_folder
from .safe_read import SafeLoadPlanner, SafeReader, is_file_name, read_metadata

log = logging.getLogger(__name__)

__all__ = ["export_safetensors", "load_safetensors"]

INDEX = "model.safetensors.index.json"
# Module path components of torch.compile (OptimizedModule) and activation checkpointing
# (CheckpointWrapper), which DCP's get_state_dict also drops.
WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")


def _read_tensors(folder: Path, prefix: str | None) -> dict[str, torch.Tensor]:
    """The ``prefix`` tensors of a step folder (None: its model's), after every file was checked
    against its manifest."""
    manifest = verify_folder(folder)
    files = sorted(manifest["files"])
    parsed = read_metadata(folder, files)  # once: DCP's reader below reads by this checked parse
    metadata = parsed.state_dict_metadata
    key_format = format_of_manifest(manifest)
    if prefix is None:
        prefix, chosen = key_format.model, [k for k in metadata if key_format.part(k) == "model"]
    else:
        chosen = [k for k in metadata if k.startswith(prefix)]
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key in chosen
        if isinstance(meta := metadata[key], TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{folder} holds no model tensors" + (f" under '{prefix}'" if prefix else ""))
    reader, planner = SafeReader(folder, files, parsed), SafeLoadPlanner()
    try:
        with single_process():  # "assuming the intent is to load in a single process": it is
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # a BaseException
        raise CheckpointError(f"{folder}: DCP could not read the checkpoint: {e}") from e
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
    prefix: str | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    config: Any = None,
) -> list[Path]:
    """Write the model's tensors of a checkpoint step folder as safetensors; returns the files.

    ``from_pretrained`` also needs a ``config.json`` beside the weights: ``config`` (a Hugging Face
    config, e.g. ``model.config``, or a dict) is written there; without it and without one already
    in ``out_dir``, a warning says so.

    Names are the model's FQNs (a checkpoint of pipeline stages holds every stage's: the whole
    model), so a checkpoint of a Hugging Face model exports under the names ``from_pretrained``
    expects. ``prefix`` picks other entries by their checkpoint keys instead, and drops it from
    the names. With ``max_shard_bytes``
    the weights are split into ``model-0000i-of-0000n.safetensors`` plus an index file. The folder
    is checked as ``load_checkpoint`` checks it (manifest, every file's size and CRC-32) before
    anything is read or written; a failure is a CheckpointError naming the file.
    """
    tensors = _read_tensors(Path(checkpoint), prefix)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, config)
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


def _write_config(out: Path, config: Any) -> None:
    """``config.json`` for ``from_pretrained``: from ``config`` when given, else say it is missing."""
    if config is None:
        if not (out / "config.json").is_file():
            log.warning(
                "%s has no config.json, which from_pretrained needs: pass config=model.config to "
                "export_safetensors, or call model.config.save_pretrained(%r)",
                out,
                str(out),
            )
        return
    if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig
        (out / "config.json").write_text(config.to_json_string())
    else:
        (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")


def _file_of(path: Path) -> dict[str, Path]:
    """Tensor name -> file: from ``path`` itself (a ``.safetensors`` file), or in the folder ``path``
    from its index or its single ``model.safetensors``."""
    index = path / INDEX
    if index.is_file():
        return _indexed(index)
    single = path if path.is_file() else path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(
            f"{path}: no safetensors file there (neither model.safetensors nor {INDEX}); pass the "
            "folder save_pretrained or export_safetensors wrote, or a .safetensors file"
        )
    with _opened(single) as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _indexed(index: Path) -> dict[str, Path]:
    """The index's weight map, every file a file of the index's own folder that exists."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({e!r}); export or download it again") from e
    if type(weight_map) is not dict:
        raise CheckpointError(f"{index}: 'weight_map' is not a map of tensor names to files")
    for name, file in weight_map.items():
        if not is_file_name(file):
            raise CheckpointError(
                f"{index}: {name!r} is in {file!r}, not a file name of the index's folder; nothing was loaded"
            )
        if not (index.parent / file).is_file():
            raise CheckpointError(f"{index}: {name!r} is in {file!r}, which is missing; nothing was loaded")
    return {name: index.parent / file for name, file in weight_map.items()}


@contextlib.contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """``safe_open``, its refusal of a truncated or damaged file a CheckpointError naming it."""
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({e}); export or download it again"
        ) from e
    with handle as f:
        yield f


def _unwrapped(name: str) -> str:
    """``name`` without the components wrappers add, as DCP's get_state_dict writes FQNs."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """What ``model.state_dict()`` holds, by unwrapped FQN: parameters (a tied one once, under its
    first name) and persistent buffers."""
    out: dict[str, torch.Tensor] = {_unwrapped(name): p for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in non_persistent_buffers(module):
                out.setdefault(_unwrapped(f"{prefix}.{name}" if prefix else name), buffer)
    return out


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the file headers alone (each file opened, so checked whole:
    safetensors refuses a file its header does not cover exactly)."""
    shapes: dict[str, tuple[int, ...]] = {}
    misplaced: list[str] = []
    for file in sorted(set(files.values())):
        with _opened(file) as f:
            here = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        misplaced += [f"{n} ({file.name})" for n, where in files.items() if where == file and n not in here]
        shapes.update(here)
    if misplaced:
        raise CheckpointError(
            f"the index puts tensors in files that do not hold them: {_listed(misplaced)}; nothing was loaded"
        )
    return shapes


def _check_names(
    where: Path, targets: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], strict: bool
) -> None:
    """CheckpointError naming the FQNs, before anything is copied, on every rank alike."""
    missing, unexpected = targets.keys() - shapes.keys(), shapes.keys() - targets.keys()
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{where} does not match the model (names without the {'/'.join(WRAPPERS)} wrapper parts). "
            f"Missing from the files: {_listed(missing)}. Unexpected in the files: {_listed(unexpected)}. "
            "Nothing was loaded; pass strict=False to load the names both have."
        )
    wrong = [
        f"{name}: {shapes[name]} in the files, {tuple(t.shape)} in the model"
        for name, t in targets.items()
        if name in shapes and shapes[name] != tuple(t.shape)
    ]
    if wrong:
        raise CheckpointError(f"{where}: shape mismatch: {_listed(wrong)}. Nothing was loaded.")


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return shown or "nothing"


def _plan(model: nn.Module, folder: Path, strict: bool) -> tuple[tuple[dict, dict], dict[str, Any]]:
    """This rank's files and targets, every name and shape checked; the facts every rank must share:
    the names it will load, with their shapes."""
    files, targets = _file_of(folder), _targets(model)
    shapes = _shapes(files)
    _check_names(folder, targets, shapes, strict)
    return (files, targets), {"names loaded": {n: shapes[n] for n in targets if n in files}}


def _load_group(model: nn.Module, group: dist.ProcessGroup | None) -> tuple[bool, dist.ProcessGroup | None]:
    """Whether ranks load together, and over which group: ``group`` if given, else every rank where
    the model holds a DTensor (its shards are loaded collectively); a plain model is a rank's own."""
    if group is not None or not dist.is_initialized():
        return group is not None, group
    return any(isinstance(t, DTensor) for t in _targets(model).values()), None


@torch.no_grad()
def load_safetensors(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Copy weights from safetensors files into ``model``'s (possibly sharded) parameters and
    persistent buffers. Names are matched without wrapper components (``_orig_mod.``,
    ``_checkpoint_wrapped_module.``); every name and shape is checked before anything is copied.
    Collective over ``process_group`` (default: every rank when the model holds DTensors, none for
    a plain model): a file or name missing on one rank, or another ``strict``, raises on every rank
    of the group before anything is copied."""
    together, group = _load_group(model, process_group)
    if not together:
        (files, targets), _ = _plan(model, Path(folder), strict)
    else:
        files, targets = agree(
            "load_safetensors", group, lambda: _plan(model, Path(folder), strict), strict=strict
        )
    # Every layout before any copy (collective, in model order on every rank; may refuse a placement).
    todo = [(name, t, layout_of(t, name)) for name, t in targets.items() if name in files]
    with contextlib.ExitStack() as stack:
        opened = {
            file: stack.enter_context(safe_open(str(file), framework="pt"))
            for file in sorted(set(files.values()))
        }
        for name, t, layout in todo:
            local = local_of(t)
            if local.numel():  # an empty FSDP2 piece may be (0, 0) where the block is (0, n)
                block = _read_block(opened[files[name]].get_slice(name), layout.blocks[layout.rank], t.shape)
                local.copy_(block)  # cast to the model's dtype, as load_state_dict does


def _read_block(piece: Any, block: Block, shape: Sequence[int]) -> torch.Tensor:
    """Read only ``block``'s rows and columns (one interval per dimension for Shard layouts)."""
    if not shape:
        return piece[()]  # a 0-d tensor (a step counter): ``[:]`` cannot slice it
    if all(len(dim) == 1 for dim in block):
        return piece[tuple(slice(start, stop) for ((start, stop),) in block)]
    out = piece[:]  # interleaved pieces: read whole, then keep this block's indices
    for d, dim in enumerate(block):
        index = torch.cat([torch.arange(start, stop) for start, stop in dim])
        out = out.index_select(d, index)
    return out
