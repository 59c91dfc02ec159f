"""Whether a checkpoint fits the model parts and optimizers a load fills, checked from its metadata
and settings before anything is loaded: the same tensors with the same shapes, and param-group
settings that this grouping can take (format 2: per parameter; format 1: group by group)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ._dtypes import refuse_int8_conversion, warn_converted_momentum
from ._errors import CheckpointError
from ._fresh import FRESH_HINT
from .keys import KeyFormat
from .safe_read import read_entries

__all__ = ["check_compatible", "tensor_keys"]

_GROUP_KEY = re.compile(r"(\d+)\.(.+)")  # format 1, after the param_groups prefix
_GROUP_ENTRIES = ("params", "algorithm")  # format 1: what must agree between checkpoint and optimizer
_MISSING = object()


def tensor_keys(flat: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}


def match_lr_kinds(optim: dict[str, Any], metadata: Metadata, prefix: str) -> None:
    """A format-2 load's optimizer template (``optim``, its keys without ``prefix``) asks for each
    group's lr as the checkpoint holds it: a tensor where a capturable run saved its tensor lr, a
    float where a float was saved. ``Muon.load_state_dict`` then converts to this optimizer's own
    kind (``state.adopt_lr``), so a capturable run's checkpoint loads into a float-lr optimizer."""
    for key, value in list(optim.items()):
        if not (key.startswith("param_groups.") and key.endswith(".lr")):
            continue
        saved = metadata.state_dict_metadata.get(prefix + key)
        if isinstance(saved, TensorStorageMetadata) and not isinstance(value, torch.Tensor):
            optim[key] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        elif isinstance(saved, BytesStorageMetadata) and isinstance(value, torch.Tensor):
            optim[key] = 0.0  # DCP fills it with the saved float


def _short(keys: Iterable[str], most: int = 12) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_compatible(
    folder: Path,
    metadata: Metadata,
    flat_state: Mapping[str, Any],
    key_format: KeyFormat,
    everywhere: Collection[str],
    groups: list[list[str]],
) -> dict[str, Any]:
    """Raise CheckpointError, before anything is loaded, if the checkpoint's tensors are not the
    ones the load expects: this rank's ``flat_state`` (DCP-flattened templates) must all be saved
    with their shapes, and every saved tensor of the parts asked for must be among ``everywhere``
    (every rank's wanted keys: a stage loads its part, the stages together the whole checkpoint).
    A weights-only load ignores the checkpoint's optimizer entries. ``groups``: the FQNs of each
    of this rank's param groups (format 2), whose saved settings must agree within a group.
    Returns the non-tensor entries it read (every one the load reads), for the load to put in."""
    parts = {key_format.part(k) for k in flat_state} - {"other"}
    refuse_int8_conversion(folder, metadata, flat_state, key_format.optim + "state.")
    entries = {k: v for k, v in metadata.state_dict_metadata.items() if key_format.part(k) in parts}
    saved = {k: tuple(v.size) for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    wanted = tensor_keys(flat_state)
    missing, unexpected = wanted.keys() - saved.keys(), saved.keys() - set(everywhere)
    if missing or unexpected:
        why, hint = _optimizer_only(missing | unexpected, key_format)
        most = 3 if hint else 12  # the fix first; a few keys after it say enough
        raise CheckpointError(
            f"{folder} does not match this {'model and optimizer' if 'optim' in parts else 'model'}{why}."
            f"{hint} Nothing was loaded. Missing from the checkpoint: {_short(missing, most) or 'nothing'}. "
            f"Unexpected in the checkpoint: {_short(unexpected, most) or 'nothing'}."
        )
    wrong = [f"{k}: saved {saved[k]}, expected {wanted[k]}" for k in sorted(wanted) if saved[k] != wanted[k]]
    if wrong:
        raise CheckpointError(f"{folder}: shape mismatch: {_short(wrong)}. Nothing was loaded.")
    # Every non-tensor entry the load reads, read now: a refused one must fail before anything loads.
    names = [
        k
        for k, v in entries.items()
        if type(v) is BytesStorageMetadata and (k in flat_state or key_format.format == 1)
    ]
    saved_entries = read_entries(folder, metadata, names)
    if "optim" in parts:
        _check_settings(folder, saved_entries, flat_state, key_format, groups)
    warn_converted_momentum(folder, metadata, flat_state, key_format.optim + "state.")
    return saved_entries


def _optimizer_only(keys: Iterable[str], key_format: KeyFormat) -> tuple[str, str]:
    """What the error says, and the way out, when the weights match and only the optimizer state
    does not; nothing when the weights differ too."""
    if any(key_format.part(k) != "optim" for k in keys):
        return "", ""
    why = (
        ": the weights match, the optimizer state does not (the checkpoint was saved with another "
        "optimizer or other param groups, or without an optimizer)"
    )
    return why, f" {FRESH_HINT}"


def _check_settings(
    folder: Path,
    saved: Mapping[str, Any],
    flat: Mapping[str, Any],
    key_format: KeyFormat,
    groups: list[list[str]],
) -> None:
    prefix = key_format.optim + "param_groups."
    if key_format.format == 1:
        problems = _index_problems(folder, flat, saved, prefix)
    else:
        problems = [p for i, fqns in enumerate(groups) for p in _fqn_problems(i, fqns, flat, saved, prefix)]
    if problems:
        raise CheckpointError(
            f"{folder}: the optimizer's param groups are not the checkpoint's: {'; '.join(problems)}. "
            "Build it with the groups it was saved with (e.g. the same split_params call). "
            "Nothing was loaded. " + FRESH_HINT
        )


def _fqn_problems(
    i: int, fqns: list[str], flat: Mapping[str, Any], saved: Mapping[str, Any], prefix: str
) -> list[str]:
    """Format 2: each setting this group has must be saved alike for all its parameters (a group
    takes one value), and the saved algorithm must be this group's."""
    if not fqns:
        return []
    head = f"{prefix}{fqns[0]}."
    keys = [k[len(head) :] for k in flat if k.startswith(head) and "." not in k[len(head) :]]
    problems = []
    for key in keys:
        values = [(f, saved.get(f"{prefix}{f}.{key}", _MISSING)) for f in fqns]
        values = [(f, v) for f, v in values if v is not _MISSING]
        if key == "algorithm":
            ours = flat[f"{head}{key}"]
            problems += [f"{f}: {ours!r} here, {v!r} in the checkpoint" for f, v in values if v != ours][:3]
        odd = [(f, v) for f, v in values if not _same(v, values[0][1])]
        if odd:
            (f0, v0), (f1, v1) = values[0], odd[0]
            problems.append(
                f"group {i} takes one {key}, but it was saved as {v0!r} for {f0} and {v1!r} for {f1} "
                "(split them into groups as saved)"
            )
    return problems


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


def _groups(entries: Mapping[str, Any], prefix: str) -> dict[int, dict[str, Any]]:
    """Format 1: param group index -> its ``params`` (FQNs) and ``algorithm`` among ``entries``."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        if key.startswith(prefix) and (match := _GROUP_KEY.fullmatch(key[len(prefix) :])):
            entry = out.setdefault(int(match.group(1)), {})
            if match.group(2) in _GROUP_ENTRIES:
                entry[match.group(2)] = value
    return out


def _index_problems(
    folder: Path, flat: Mapping[str, Any], saved: Mapping[str, Any], prefix: str
) -> list[str]:
    """Format 1: the optimizer's groups must be the checkpoint's, index by index: the same algorithm
    and the same parameter FQNs. DCP restores hyperparameters by group index and state by FQN, so
    another split or order would put one group's settings on another's parameters."""
    ours, theirs = _groups(flat, prefix), _groups(saved, prefix)
    if not ours:
        return []
    if theirs and len(ours) != len(theirs):
        raise CheckpointError(
            f"{folder}: the optimizer was saved with {len(theirs)} param group(s) but has {len(ours)}; "
            "build it with the same groups (e.g. the same split_params call). Nothing was loaded. "
            + FRESH_HINT
        )
    return [p for i in sorted(ours) for p in _group_problems(i, ours[i], theirs.get(i, {}))]


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
