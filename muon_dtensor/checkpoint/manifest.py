"""Checksums, manifests and compatibility checks for checkpoint folders: pure file work, no ranks.

DCP keeps no checksums, so one flipped bit in a shard would load silently with a wrong value. The
save helper records a CRC-32 of every file in ``manifest.json`` and the load helper verifies them.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "check_compatible",
    "complete_steps",
    "crc32_file",
    "read_manifest",
    "step_dir",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked: corrupt, incomplete or of another model."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_steps(root: str | os.PathLike) -> list[int]:
    """Steps whose folder has a published manifest, oldest first. Half-written saves never count:
    they live under a temporary name until every rank finished and the manifest is in place."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP.match(child.name)
        if match and (child / MANIFEST).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path: Path) -> dict[str, int]:
    return {"bytes": path.stat().st_size, "crc32": crc32_file(path)}


def write_manifest(folder: Path, files: Mapping[str, Mapping[str, int]], info: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` atomically (temporary file, fsync, rename)."""
    body = json.dumps({"files": dict(sorted(files.items())), **info}, indent=1, sort_keys=True)
    part = folder / (MANIFEST + ".part")
    with open(part, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    part.rename(folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{folder / MANIFEST}: unreadable manifest ({e}); the save did not finish"
        ) from e


def verify_files(folder: Path, names: Iterable[str], manifest: Mapping[str, Any]) -> list[str]:
    """Problems with the given files of ``folder`` against the manifest, one sentence each."""
    problems = []
    for name in names:
        path, want = folder / name, manifest["files"][name]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, expected {want['bytes']} (truncated?)")
        elif crc32_file(path) != want["crc32"]:
            problems.append(f"{path}: checksum mismatch (corrupted)")
    return problems


def _tensor_keys(flat: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _short(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:12])
    return shown + (f" and {len(keys) - 12} more" if len(keys) > 12 else "")


def _part(key: str) -> str:
    return key.split(".", 1)[0]


def check_compatible(folder: Path, flat_state: Mapping[str, Any]) -> None:
    """Raise CheckpointError, before anything is loaded, if the checkpoint's tensors are not the
    ones ``flat_state`` (DCP-flattened ``{"model": ..., "optim": ...}``) expects.

    Only the parts ``flat_state`` asks for are compared: a weights-only load (``{"model": ...}``)
    ignores the checkpoint's optimizer entries, a full load checks both parts.
    """
    parts = {_part(k) for k in flat_state}
    metadata = {
        k: v
        for k, v in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items()
        if _part(k) in parts
    }
    saved = {k: tuple(v.size) for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    wanted = _tensor_keys(flat_state)
    missing, unexpected = wanted.keys() - saved.keys(), saved.keys() - wanted.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not match this {'model and optimizer' if 'optim' in parts else 'model'}. "
            "Missing from the checkpoint: "
            f"{_short(missing) or 'nothing'}. Unexpected in the checkpoint: {_short(unexpected) or 'nothing'}. "
            "Nothing was loaded."
        )
    wrong = [f"{k}: saved {saved[k]}, expected {wanted[k]}" for k in sorted(wanted) if saved[k] != wanted[k]]
    if wrong:
        raise CheckpointError(f"{folder}: shape mismatch: {_short(wrong)}. Nothing was loaded.")
    groups = lambda keys: {k.split(".")[2] for k in keys if k.startswith("optim.param_groups.")}  # noqa: E731
    ours, theirs = groups(flat_state), groups(metadata)
    if ours and theirs and len(ours) != len(theirs):
        raise CheckpointError(
            f"{folder}: the optimizer was saved with {len(theirs)} param group(s) but has {len(ours)}; "
            "build it with the same groups (e.g. the same split_params call). Nothing was loaded."
        )
