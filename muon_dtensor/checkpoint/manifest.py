"""Checksums, manifests and compatibility checks for checkpoint folders: pure file work, no ranks.

DCP keeps no checksums, so one flipped bit in a shard would load silently with a wrong value. The
save helper records a CRC-32 of every file in ``manifest.json`` and the load helper verifies them.
The manifest carries a SHA-256 of its own canonical text, and is only read back if its bytes are
exactly that text, so a flipped byte anywhere in it fails to parse or fails the check.

These checksums find damage, not edits: anyone who can write the folder can write a new manifest.
So a manifest is read as untrusted data too: its entries must be file names of its own step folder,
its step that of the folder's name, and DCP's files are read without unpickling (``safe_read``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._errors import CheckpointError
from .extra_tensors import PLACEHOLDER, is_extra_tensor, split_tensors
from .safe_read import METADATA, is_file_name

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "check_extra",
    "complete_steps",
    "crc32_file",
    "read_manifest",
    "step_dir",
    "verify_files",
    "verify_folder",
    "write_manifest",
]

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{8,})$")
_CHECKSUM = "checksum"
# The keys of a manifest written before manifests carried their own checksum.
_LEGACY_KEYS = {"extra", "files", "step", "time", "torch", "world_size"}
FORMATS = (1, 2)  # checkpoint/layout.py: BY_INDEX, PER_FQN
_JSON_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 64


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


def _render(content: Mapping[str, Any]) -> str:
    """The one text a manifest with this content is written as."""
    return json.dumps(content, indent=1, sort_keys=True, allow_nan=False)


def _digest(body: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_render(body).encode()).hexdigest()


def write_manifest(folder: Path, files: Mapping[str, Mapping[str, int]], info: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` atomically (temporary file, fsync, rename), with a ``"checksum"`` of
    its canonical text without that key."""
    body = {"files": dict(sorted(files.items())), **info}
    text = _render({**body, _CHECKSUM: _digest(body)})
    part = folder / (MANIFEST + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    part.rename(folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest without its checksum; CheckpointError unless its bytes are exactly the canonical
    text of content that matches the checksum (a manifest of before the checksum: the legacy keys)."""
    path = folder / MANIFEST
    try:
        text = path.read_bytes().decode("utf-8")
        content = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e}); the save did not finish") from e
    if not isinstance(content, dict):
        raise CheckpointError(f"{path}: not a manifest (corrupted)")
    checksum = content.pop(_CHECKSUM, None)
    if not _signed(text, content, checksum):
        raise CheckpointError(
            f"{path}: the manifest fails its checksum (corrupted or edited); nothing was loaded"
        )
    _check_content(folder, content)
    return content


def _signed(text: str, content: dict[str, Any], checksum: Any) -> bool:
    """Whether ``text`` is exactly the canonical text of ``content`` and its checksum (a manifest of
    before the checksum: of the legacy keys alone)."""
    try:
        if checksum is None and content.keys() == _LEGACY_KEYS:
            return _render(content) == text
        return _render({**content, _CHECKSUM: checksum}) == text and checksum == _digest(content)
    except (ValueError, RecursionError):  # NaN or infinity in a corrupted number; deep nesting
        return False


def _check_content(folder: Path, content: dict[str, Any]) -> None:
    """What the readers rely on: ``files`` maps file names of this folder (DCP's ``.metadata``
    among them) to sizes and checksums, ``step`` is the folder's, ``extra`` is a dict, ``format``
    one this version reads (an unknown one would be read as format 1)."""
    path, files = folder / MANIFEST, content.get("files")
    if type(files) is not dict or not all(_is_record(r) for r in files.values()):
        raise CheckpointError(
            f"{path}: 'files' is not a map of file names to sizes and checksums; nothing was loaded"
        )
    for name in files:
        if not is_file_name(name):
            raise CheckpointError(
                f"{path}: the entry {name!r} is not a file name of the step folder (a path outside it or "
                "below it); the manifest was edited, nothing was loaded"
            )
    if METADATA not in files:
        raise CheckpointError(f"{path}: DCP's {METADATA} is not among the checked files; nothing was loaded")
    step, match = content.get("step"), _STEP.match(folder.name)
    if type(step) is not int or type(content.get("extra", {})) is not dict:
        raise CheckpointError(f"{path}: 'step' is not an int or 'extra' not a dict; nothing was loaded")
    fmt = content.get("format", 1)  # a manifest of before formats had none: format 1
    if type(fmt) is not int or fmt not in FORMATS:
        raise CheckpointError(
            f"{path}: the manifest's 'format' is {fmt!r}, which this version cannot read (it reads formats "
            f"{', '.join(map(str, FORMATS))}); nothing was loaded. Load it with the muon_dtensor that saved it"
        )
    if match and int(match.group(1)) != step:
        raise CheckpointError(
            f"{path}: the manifest is of step {step}, its folder is {folder.name} (a folder renamed or copied "
            "over another); nothing was loaded. Load the step it was saved as"
        )


def _is_record(record: Any) -> bool:
    return type(record) is dict and all(type(record.get(k)) is int for k in ("bytes", "crc32"))


def verify_folder(folder: Path) -> dict[str, Any]:
    """The manifest of the step folder ``folder``, after every file was checked against it (one
    process); CheckpointError naming the files, or the folder and what to pass instead."""
    if not (folder / MANIFEST).is_file():
        steps = complete_steps(folder)
        if steps:
            raise CheckpointError(
                f"{folder} is a checkpoint root, not a step folder; pass one of its steps, e.g. "
                f"{step_dir(folder, steps[-1])}"
            )
        raise CheckpointError(
            f"{folder}: no {MANIFEST}, so not a step folder published by save_checkpoint (a save that did not "
            "finish, or another tool's folder); pass a folder root/step_XXXXXXXX that save_checkpoint wrote"
        )
    manifest = read_manifest(folder)
    problems = verify_files(folder, sorted(manifest["files"]), manifest)
    if problems:
        raise CheckpointError("checkpoint files failed verification: " + "; ".join(problems))
    return manifest


def check_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as the manifest stores it (a copy), or TypeError / ValueError naming the first key JSON
    would not give back unchanged. Allowed: a dict with str keys (not ``"step"``, which
    ``load_checkpoint`` returns the step under) of str, int, finite float, bool, None, and lists and
    dicts (str keys) of those, and plain dense tensors (``checkpoint/extra_tensors.py``: an RNG state
    comes back exactly, as each rank's own). Not: tuples, int keys, NaN, subclasses (a numpy float)."""
    if extra is None:
        return {}
    if type(extra) is not dict:
        raise TypeError(f"extra should be a dict but is of type {type(extra).__name__}")
    if "step" in extra:
        raise ValueError(
            "extra['step']: the key 'step' is reserved (load_checkpoint returns the saved step under it); "
            "use another key"
        )
    _check_json(extra, "extra", 0)
    stored = split_tensors(extra)[0]  # tensors as placeholders: their values are DCP entries
    copy = json.loads(json.dumps(stored, allow_nan=False))  # a snapshot: an async save may publish later
    if copy != stored:  # what the walk cannot see
        raise ValueError("extra does not survive JSON unchanged")
    return copy


def _check_json(value: Any, where: str, depth: int) -> None:
    kind = type(value)
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH} levels (a circular reference?)")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{where} is {value}; JSON has no NaN or infinity")
    if kind in _JSON_SCALARS or is_extra_tensor(value, where):
        return
    if kind is list:
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    if kind is dict:
        if PLACEHOLDER in value:
            raise ValueError(
                f"{where}: the key {PLACEHOLDER!r} is reserved (it marks a tensor); use another key"
            )
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError(
                    f"{where}: the key {key!r} is of type {type(key).__name__}; JSON keys are str "
                    f"(it would come back as {json.dumps(str(key))})"
                )
            _check_json(item, f"{where}[{key!r}]", depth + 1)
        return
    hint = "; use a list" if kind is tuple else ""
    raise TypeError(
        f"{where} is of type {kind.__name__}, which JSON would not give back unchanged{hint}. extra holds "
        "str, int, finite float, bool, None, and lists and dicts (with str keys) of those"
    )


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
