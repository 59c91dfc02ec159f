"""Checksums, manifests and compatibility checks for checkpoint folders: pure file work, no ranks.

DCP keeps no checksums, so one flipped bit in a shard would load silently with a wrong value. The
save helper records a CRC-32 of every file in ``manifest.json`` and the load helper verifies them.
The manifest carries a SHA-256 of its own canonical text, and is only read back if its bytes are
exactly that text, so a flipped byte anywhere in it fails to parse or fails the check.
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

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ._fresh import FRESH_HINT

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "check_compatible",
    "check_extra",
    "complete_steps",
    "crc32_file",
    "read_manifest",
    "step_dir",
    "verify_files",
    "write_manifest",
]

MANIFEST = "manifest.json"
_STEP = re.compile(r"^step_(\d{8,})$")
_CHECKSUM = "checksum"
# The keys of a manifest written before manifests carried their own checksum.
_LEGACY_KEYS = {"extra", "files", "step", "time", "torch", "world_size"}
_JSON_SCALARS = (str, int, float, bool, type(None))
_MAX_DEPTH = 64
_GROUP_KEY = re.compile(r"optim\.param_groups\.(\d+)\.(.+)")
_GROUP_ENTRIES = ("params", "algorithm")  # what must agree between the checkpoint and the optimizer


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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e}); the save did not finish") from e
    if not isinstance(content, dict):
        raise CheckpointError(f"{path}: not a manifest (corrupted)")
    checksum = content.pop(_CHECKSUM, None)
    try:
        if checksum is None and content.keys() == _LEGACY_KEYS and _render(content) == text:
            return content
        if _render({**content, _CHECKSUM: checksum}) == text and checksum == _digest(content):
            return content
    except ValueError:  # NaN or infinity in a corrupted number
        pass
    raise CheckpointError(
        f"{path}: the manifest fails its checksum (corrupted or edited); nothing was loaded"
    )


def check_extra(extra: Any) -> dict[str, Any]:
    """``extra`` as the manifest stores it (a copy), or TypeError / ValueError naming the first key JSON
    would not give back unchanged. Allowed: a dict with str keys (not ``"step"``, which
    ``load_checkpoint`` returns the step under) of str, int, finite float, bool, None, and lists and
    dicts (str keys) of those. Not: tensors, tuples, int keys, NaN, subclasses (a numpy float)."""
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
    copy = json.loads(json.dumps(extra, allow_nan=False))  # a snapshot: an async save may publish later
    if copy != extra:  # what the walk cannot see
        raise ValueError("extra does not survive JSON unchanged")
    return copy


def _check_json(value: Any, where: str, depth: int) -> None:
    kind = type(value)
    if depth > _MAX_DEPTH:
        raise ValueError(f"{where}: nested deeper than {_MAX_DEPTH} levels (a circular reference?)")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{where} is {value}; JSON has no NaN or infinity")
    if kind in _JSON_SCALARS:
        return
    if kind is list:
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", depth + 1)
        return
    if kind is dict:
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
    everything = FileSystemReader(str(folder)).read_metadata()
    metadata = {k: v for k, v in everything.state_dict_metadata.items() if _part(k) in parts}
    saved = {k: tuple(v.size) for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    wanted = _tensor_keys(flat_state)
    missing, unexpected = wanted.keys() - saved.keys(), saved.keys() - wanted.keys()
    if missing or unexpected:
        why, hint = _optimizer_only(missing | unexpected)
        raise CheckpointError(
            f"{folder} does not match this {'model and optimizer' if 'optim' in parts else 'model'}{why}. "
            "Missing from the checkpoint: "
            f"{_short(missing) or 'nothing'}. Unexpected in the checkpoint: {_short(unexpected) or 'nothing'}. "
            f"Nothing was loaded.{hint}"
        )
    wrong = [f"{k}: saved {saved[k]}, expected {wanted[k]}" for k in sorted(wanted) if saved[k] != wanted[k]]
    if wrong:
        raise CheckpointError(f"{folder}: shape mismatch: {_short(wrong)}. Nothing was loaded.")
    _check_groups(folder, flat_state, everything)


def _optimizer_only(keys: Iterable[str]) -> tuple[str, str]:
    """What the error says, and the way out, when the weights match and only the optimizer state
    does not; nothing when the weights differ too."""
    if any(_part(k) != "optim" for k in keys):
        return "", ""
    why = (
        ": the weights match, the optimizer state does not (the checkpoint was saved with another "
        "optimizer or other param groups, or without an optimizer)"
    )
    return why, f" {FRESH_HINT}"


def _groups(entries: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Param group index -> its ``params`` (FQNs) and ``algorithm`` among flattened ``entries``."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        if match := _GROUP_KEY.fullmatch(key):
            entry = out.setdefault(int(match.group(1)), {})
            if match.group(2) in _GROUP_ENTRIES:
                entry[match.group(2)] = value
    return out


def _saved_groups(folder: Path, metadata: Metadata) -> dict[int, dict[str, Any]]:
    """The checkpoint's param groups' ``params`` and ``algorithm``: a few small entries, read by this
    rank alone through DCP's reader and planner protocol (no collective), before anything is loaded."""
    keys = metadata.state_dict_metadata
    indices = {int(m.group(1)) for key in keys if (m := _GROUP_KEY.fullmatch(key))}
    names = (f"optim.param_groups.{i}.{entry}" for i in indices for entry in _GROUP_ENTRIES)
    wanted: dict[str, Any] = {name: None for name in names if name in keys}
    if wanted:
        reader, planner = FileSystemReader(str(folder)), DefaultLoadPlanner(allow_partial_load=True)
        planner.set_up_planner(wanted, metadata, True)
        reader.set_up_storage_reader(metadata, True)
        plan = reader.prepare_global_plan([reader.prepare_local_plan(planner.create_local_plan())])[0]
        reader.read_data(planner.finish_plan(plan), planner).wait()
    groups = _groups(wanted)
    return {i: groups.get(i, {}) for i in indices}


def _group_problems(i: int, here: Mapping[str, Any], saved: Mapping[str, Any]) -> list[str]:
    problems = []
    algorithms = here.get("algorithm"), saved.get("algorithm")
    if None not in algorithms and algorithms[0] != algorithms[1]:
        problems.append(f"group {i}: {algorithms[0]!r} here, {algorithms[1]!r} in the checkpoint")
    if isinstance(here.get("params"), list) and isinstance(saved.get("params"), list):
        ours, theirs = set(here["params"]), set(saved["params"])
        if ours != theirs:
            problems.append(
                f"group {i}: parameters only here: {_short(ours - theirs) or 'none'}, "
                f"only in the checkpoint: {_short(theirs - ours) or 'none'}"
            )
    return problems


def _check_groups(folder: Path, flat_state: Mapping[str, Any], metadata: Metadata) -> None:
    """The optimizer's groups must be the checkpoint's, index by index: the same algorithm and the
    same parameter FQNs. DCP restores hyperparameters by group index and state by FQN, so another
    split or order would put one group's settings on another's parameters."""
    ours = _groups(flat_state)
    if not ours:
        return
    theirs = _saved_groups(folder, metadata)
    if theirs and len(ours) != len(theirs):
        raise CheckpointError(
            f"{folder}: the optimizer was saved with {len(theirs)} param group(s) but has {len(ours)}; "
            "build it with the same groups (e.g. the same split_params call). Nothing was loaded. "
            + FRESH_HINT
        )
    problems = [p for i in sorted(ours) for p in _group_problems(i, ours[i], theirs.get(i, {}))]
    if problems:
        raise CheckpointError(
            f"{folder}: the optimizer's param groups are not the checkpoint's: {'; '.join(problems)}. "
            "Build it with the same groups in the same order (e.g. the same split_params call). "
            "Nothing was loaded. " + FRESH_HINT
        )
