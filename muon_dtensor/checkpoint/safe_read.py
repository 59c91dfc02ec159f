"""Reading a checkpoint folder as data: nothing in it can run code.

DCP pickles its ``.metadata`` and ``torch.save``s non-tensor entries (param-group values), and its own
reader and planner load both with a full unpickler (``torch.load(weights_only=False)``), which calls
whatever the file names. Here ``.metadata`` goes through an unpickler that knows only DCP's metadata
classes, ``torch.Size``, dtypes and layouts; entries go through ``torch.load(weights_only=True)``.
``SafeReader`` and ``SafeLoadPlanner`` make ``dcp.load`` itself read that way.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pathlib
import pickle
import re
from collections import OrderedDict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..base.torch_dist import dcp_records
from ._errors import CheckpointError

__all__ = [
    "METADATA",
    "SafeLoadPlanner",
    "SafeReader",
    "bytes_entries",
    "is_file_name",
    "read_entries",
    "read_metadata",
]

METADATA = ".metadata"
_STORAGE_INFO, _MEM_FORMAT_ENCODING, _GET_LAYOUT = dcp_records()
# The objects a DCP metadata pickle builds (NEWOBJ, then BUILD fills their fields)
_RECORDS = (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    _STORAGE_INFO,
)
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")  # StorageMeta.checkpoint_id
# Types a pickle cannot set attributes on (built in, immutable), and torch's own values
_IMMUTABLE: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): OrderedDict,
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # no separator, so never a path outside or below a folder


def is_file_name(name: Any) -> bool:
    """Whether ``name`` names a file of the folder itself (DCP's and safetensors' names do)."""
    return type(name) is str and _FILE_NAME.fullmatch(name) is not None and name not in (".", "..")


class _Encoding:
    """A memory-format code as the pickle gave it, equal to the ``_MEM_FORMAT_ENCODING`` member of
    its value (all ``TensorProperties.__setstate__`` asks of it): the shared member itself never
    reaches the pickle, where a BUILD could set attributes on it."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        value = getattr(other, "value", None)
        return isinstance(other, _MEM_FORMAT_ENCODING) and type(self.value) is int and value == self.value


def _record(cls: type) -> type:
    """A stand-in for the record class ``cls``, made for one parse: NEWOBJ or a call makes a plain
    ``cls`` instance. A BUILD on the stand-in itself sets attributes on it alone, never on ``cls``."""

    def new(stand_in: type, *args: Any, **kwargs: Any) -> Any:
        record: Any = object.__new__(cls)
        if args or kwargs:
            record.__init__(*args, **kwargs)
        return record

    return type(cls.__name__, (cls,), {"__new__": new, "__slots__": ()})


def _allowed() -> dict[tuple[str, str], Any]:
    """What ``find_class`` hands one parse: stand-ins and functions made for it (a BUILD on them is
    lost with the parse), immutable types, never a shared class, enum member or function itself."""
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__name__): _record(c) for c in _RECORDS}
    allowed[(_MEM_FORMAT_ENCODING.__module__, _MEM_FORMAT_ENCODING.__name__)] = lambda value: _Encoding(value)
    allowed[("torch.serialization", "_get_layout")] = lambda name: _GET_LAYOUT(name)
    for name in _PATHS:
        path = functools.partial(getattr(pathlib, name))
        allowed |= {("pathlib", name): path, ("pathlib._local", name): path}
    return allowed | _IMMUTABLE


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's C unpickler with an allow-list (``_allowed``): what it names is made for this parse
    or cannot take attributes, so a pickle sets attributes on nothing the process shares."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, _TORCH_VALUES):
            return value
        raise CheckpointError(f"it names {module}.{name}, which DCP metadata never holds")


def read_metadata(folder: Path, files: Collection[str] | None = None) -> Metadata:
    """DCP's metadata of ``folder``, unpickled with the allow-list and checked: every file it names
    must be among ``files`` (the manifest's, when given). CheckpointError naming the file otherwise."""
    path = folder / METADATA
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure of untrusted bytes is the same refusal
        raise CheckpointError(
            f"{path}: not DCP metadata ({e}); nothing was loaded. The step folder was damaged or edited: "
            "use another step, or one saved by save_checkpoint"
        ) from e
    _check_metadata(path, metadata, files)
    return metadata


def _check_metadata(path: Path, metadata: Any, files: Collection[str] | None) -> None:
    """The types DCP's planner relies on, and the files the metadata sends it to."""
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if type(metadata) is not Metadata or type(entries) is not dict or type(storage) is not dict:
        raise CheckpointError(f"{path}: not DCP metadata (corrupted or edited); nothing was loaded")
    for key, entry in entries.items():
        if type(key) is not str or not _is_entry(entry):
            raise CheckpointError(
                f"{path}: the entry {key!r} is not a tensor or bytes entry; nothing was loaded"
            )
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if type(index) is not MetadataIndex or type(info) is not _STORAGE_INFO:
            raise CheckpointError(f"{path}: storage entry {index!r} is malformed; nothing was loaded")
        if files is not None and name not in files:
            raise CheckpointError(
                f"{path}: {index.fqn} is stored in {name!r}, which is not a checked file of the step folder "
                f"({', '.join(sorted(files))}); the folder was edited, nothing was loaded"
            )


def _is_entry(entry: Any) -> bool:
    if type(entry) is BytesStorageMetadata:
        return True
    return (
        type(entry) is TensorStorageMetadata
        and type(entry.size) is torch.Size
        and type(entry.properties) is TensorProperties
        and isinstance(entry.properties.dtype, torch.dtype)
        and type(entry.chunks) is list
        and all(type(c) is ChunkStorageMetadata for c in entry.chunks)
    )


class SafeReader(FileSystemReader):
    """DCP's file reader with ``read_metadata`` above, or the ``metadata`` that call returned for this
    load. It never falls back to rank-local metadata (``__{rank}.metadata``), which save_checkpoint
    does not write."""

    def __init__(self, folder: Path, files: Collection[str], metadata: Metadata | None = None) -> None:
        super().__init__(str(folder))
        self.folder, self.files, self.metadata = folder, files, metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.folder}: rank-local metadata is not read")
        metadata = self.metadata if self.metadata is not None else read_metadata(self.folder, self.files)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``: plain
    containers, numbers, strings, dtypes. Anything else is a CheckpointError naming entry and file.
    ``read``: entries a check already read this way (``read_entries``), by key; they are put in the
    state as read, not read again (a load's checks read every entry it loads)."""

    def __init__(self, *args: Any, read: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read = dict(read or {})

    def create_local_plan(self) -> LoadPlan:
        plan, left = super().create_local_plan(), []
        for item in plan.items:
            fqn = item.dest_index.fqn
            if item.type == LoadItemType.BYTE_IO and fqn in self.read:
                self._put_entry(fqn, self.read[fqn])
            else:
                left.append(item)
        return dataclasses.replace(plan, items=left)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - untrusted bytes: any failure is the same refusal
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = getattr(info, "relative_path", "its file")
            raise CheckpointError(
                f"{fqn} in {where} is not plain data (numbers, strings, containers, dtypes): {_reason(e)}. "
                "Nothing was loaded; the step folder was edited or saved with such a value (a param-group "
                "entry holding an object)"
            ) from e
        self._put_entry(fqn, loaded)

    def _put_entry(self, fqn: str, value: Any) -> None:
        if self.flatten_state_dict:
            _put(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value


def _reason(e: Exception) -> str:
    """The line of torch's weights_only refusal that names the global (the rest advises
    ``weights_only=False``, the opposite of the fix here)."""
    lines = [line.strip() for line in str(e).splitlines() if "GLOBAL" in line]
    return lines[0].rstrip(".") if lines else f"{type(e).__name__}: {e}"


def _put(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """``root[path[0]][path[1]]... = value`` in containers the caller's own state already has."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


def read_entries(folder: Path, metadata: Metadata, names: Collection[str]) -> dict[str, Any]:
    """The non-tensor entries ``names`` of the checkpoint, read by this rank alone through DCP's
    reader and planner protocol (no collective)."""
    wanted: dict[str, Any] = dict.fromkeys(names)
    if not wanted:
        return wanted
    files = {info.relative_path for info in metadata.storage_data.values()}
    reader, planner = SafeReader(folder, files), SafeLoadPlanner(allow_partial_load=True)
    planner.set_up_planner(wanted, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return wanted


def bytes_entries(metadata: Metadata, parts: Collection[str]) -> list[str]:
    """The keys of the checkpoint's non-tensor entries under the top-level ``parts``."""
    return [
        key
        for key, entry in metadata.state_dict_metadata.items()
        if type(entry) is BytesStorageMetadata and key.split(".", 1)[0] in parts
    ]
