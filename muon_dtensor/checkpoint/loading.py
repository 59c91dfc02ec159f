"""``load_checkpoint``: a published step (either format, see ``keys``) or a folder torchtitan's
``CheckpointManager`` wrote, into one model part and optimizer per rank or several.

Before anything is loaded: the files are verified against their checksums (a torchtitan folder has
none: said once), the checkpoint's tensors against every rank's parts (a stage loads its part, the
stages together all of it), the saved settings against this grouping, and every non-tensor entry is
read through the safe reader. Any failure raises on every rank.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..checks.together import attempt, raise_together
from . import collectives
from ._fresh import check_optimizer_state, keep_param_names, start_fresh
from ._warnings import single_process
from .arguments_agree import agree
from .extra_tensors import fill, templates
from .fit import check_compatible, match_lr_kinds, tensor_keys
from .keys import (
    TORCHTITAN,
    KeyFormat,
    Models,
    Optimizers,
    Parts,
    PartState,
    apply,
    dcp_state,
    format_of_manifest,
    optimizer_types,
    part_states,
)
from .manifest import MANIFEST, CheckpointError, complete_steps, read_manifest, step_dir, verify_files
from .safe_read import METADATA, SafeLoadPlanner, SafeReader, bytes_entries, read_entries, read_metadata

__all__ = ["latest_step", "load_checkpoint"]

log = logging.getLogger(__name__)
# What torchtitan's CheckpointManager saves beside the model and the optimizer (its ``states`` keys).
TITAN_ENTRIES = ("lr_scheduler", "train_state", "dataloader")
_TITAN_STEP = re.compile(r"^step-(\d+)$")


def titan_steps(root: Path) -> list[int]:
    """Steps of a torchtitan checkpoint folder (``step-<N>`` with DCP metadata), oldest first."""
    if not root.is_dir():
        return []
    found = [_TITAN_STEP.match(c.name) for c in root.iterdir() if (c / METADATA).is_file()]
    return sorted(int(m.group(1)) for m in found if m)


def latest_step(root: str | os.PathLike) -> int | None:
    """The newest published step under ``root`` (or of a torchtitan checkpoint folder), or None;
    CheckpointError if ``root`` is a step folder, or if the newest step's manifest fails its
    checks (the load would refuse it)."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        raise CheckpointError(
            f"{root} is a step folder, not a checkpoint root; pass its parent {root.parent} (and step=...)"
        )
    steps = complete_steps(root)
    if not steps:
        titan = titan_steps(root)
        return titan[-1] if titan else None
    read_manifest(step_dir(root, steps[-1]))
    return steps[-1]


def _source(root: str | os.PathLike, step: int) -> tuple[Path, bool]:
    """The step folder, and whether it is torchtitan's (no manifest) rather than ours."""
    ours = step_dir(root, step)
    titan = Path(root) / f"step-{step}"
    if not ours.exists() and (titan / METADATA).is_file():
        return titan, True
    return ours, False


def _verify(folder: Path, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank checks a share of the files; every rank raises the same error naming them."""
    rank, world = collectives.rank_and_size(group)

    def checked() -> dict[str, Any]:
        manifest = read_manifest(folder)
        problems = verify_files(folder, sorted(manifest["files"])[rank::world], manifest)
        if problems:
            raise CheckpointError("checkpoint files failed verification: " + "; ".join(sorted(problems)))
        return manifest

    manifest, error = attempt(checked)
    raise_together(error, group, "load_checkpoint")
    assert manifest is not None
    return manifest


def _titan_manifest(folder: Path, rank: int) -> dict[str, Any]:
    """What a torchtitan folder stands in for a manifest with: its files, unchecked."""
    if rank == 0:
        log.warning("%s: a torchtitan checkpoint has no checksums; its files are loaded unverified", folder)
    return {"files": {p.name: {} for p in folder.iterdir() if p.is_file()}, "extra": {}, "world_size": 1}


def load_checkpoint(
    root: str | os.PathLike,
    model: Models,
    optimizer: Optimizers = None,
    *,
    step: int | None = None,
    optimizer_state: str = "load",
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Load ``step`` (default: the newest complete one) into ``model`` and ``optimizer``.

    ``model`` and ``optimizer`` may be lists, one optimizer per model part (pipeline stages,
    torchtitan's ``model_parts``); ranks may hold different parts. Returns ``{"step": ..., **extra}``,
    or None when ``root`` holds no complete checkpoint. The world size, mesh and stage layout may
    differ from the saving run's: DCP reshards and entries are keyed per parameter FQN. Before
    anything is loaded, files are verified against their checksums, the checkpoint's tensors
    against the parts of every rank and its param-group settings against the optimizers'; a failure
    raises on every rank. ``optimizer_state``: ``"load"`` (default) loads the optimizer's state and
    refuses a checkpoint without it; ``"fresh"`` loads the weights alone and restarts the optimizers
    (zero momentum, step 0). Whether optimizers are passed (and their types), ``optimizer_state``
    and ``step`` must be the same on every rank: a difference raises on every rank, naming the
    argument, before anything is read. ``root`` may also be a torchtitan checkpoint folder
    (``step-<N>`` subfolders): its weights and optimizer state load the same way, unverified, and
    what torchtitan saved beside them comes back as plain data under its own keys (``lr_scheduler``,
    ``train_state``, ``dataloader``: each a dict, as that object's ``state_dict()`` was; the
    dataloader's values stay the bytes torchtitan pickled, never unpickled here).
    """
    parts, fresh = _agreed_parts(model, optimizer, optimizer_state, step, root, process_group)
    chosen = _chosen_step(root, step, process_group)
    if chosen is None:
        return None
    folder, titan = _source(root, chosen)
    rank = collectives.rank_and_size(process_group)[0]
    manifest = _titan_manifest(folder, rank) if titan else _verify(folder, process_group)
    key_format = TORCHTITAN if titan else format_of_manifest(manifest)
    beside, parsed = _checked_titan_entries(folder, manifest["files"], process_group) if titan else ({}, None)
    state, filled = _check_and_read(folder, manifest, key_format, parts, fresh, process_group, parsed)
    _apply(state, key_format, filled, parts, fresh)
    if fresh and rank == 0:
        log.warning(_FRESH, folder)
    return {"step": chosen, **beside, **fill(manifest.get("extra", {}), state)}


_FRESH = (
    "load_checkpoint(optimizer_state='fresh'): loaded the model weights of %s; the optimizer starts "
    "fresh (zero momentum, step 0), the checkpoint's optimizer state (if any) is not used"
)


def _chosen_step(root: str | os.PathLike, step: int | None, group: dist.ProcessGroup | None) -> int | None:
    """``step``, or rank 0's newest complete step (None: none), the same on every rank."""
    chosen, error = collectives.broadcast_object(
        attempt(lambda: step if step is not None else latest_step(root)), group
    )
    if error is not None:
        raise error
    return chosen


def _agreed_parts(
    model: Models,
    optimizer: Optimizers,
    optimizer_state: str,
    step: int | None,
    root: str | os.PathLike,
    group: dist.ProcessGroup | None,
) -> tuple[Parts, bool]:
    """The rank's parts and whether its optimizers start fresh, once every rank passed the same
    arguments (``arguments_agree``): a difference or a bad argument raises on every rank."""

    def local() -> tuple[tuple[Parts, bool], dict[str, Any]]:
        parts = Parts.of(model, optimizer)
        given = next((o for o in parts.optimizers if o is not None), None)
        return (parts, check_optimizer_state(optimizer_state, given)), {}

    return agree(
        "load_checkpoint",
        group,
        local,
        optimizer=optimizer_types(optimizer),
        optimizer_state=optimizer_state,
        step=step,
        root=str(root),
    )


def _checked_titan_entries(
    folder: Path, files: Any, group: dist.ProcessGroup | None
) -> tuple[dict[str, Any], Metadata]:
    """``titan_entries``, read by every rank in the checked phase: a failure on any rank (an entry
    that is not plain data, entries that clash) raises on every rank before anything is applied.
    Also the checked parse of the metadata, which the rest of the load reuses."""

    def read() -> tuple[dict[str, Any], Metadata]:
        metadata = read_metadata(folder, files)
        return titan_entries(folder, metadata), metadata

    entries_and_parse, error = attempt(read)
    raise_together(error, group, "load_checkpoint", unchanged="Nothing was loaded")
    assert entries_and_parse is not None
    return entries_and_parse


def titan_entries(folder: Path, metadata: Metadata) -> dict[str, Any]:
    """torchtitan's non-model, non-optimizer entries (``TITAN_ENTRIES``) of ``folder``, nested by
    their dotted keys, read as plain data by this rank alone (no collective, nothing unpickled but
    ``torch.load(weights_only=True)``'s numbers, strings, bytes and containers)."""
    out: dict[str, Any] = {}
    leaves: set[str] = set()  # the keys read so far, and every dotted prefix of them
    inner: set[str] = set()
    for key, value in sorted(read_entries(folder, metadata, bytes_entries(metadata, TITAN_ENTRIES)).items()):
        *path, last = key.split(".")
        _refuse_clash(folder, key, leaves, inner)
        node = out
        for name in path:
            node = node.setdefault(name, {})
        node[last] = value
    return out


def _refuse_clash(folder: Path, key: str, leaves: set[str], inner: set[str]) -> None:
    """A CheckpointError when ``key`` and an entry read before nest in each other (``a`` holds a
    value and ``a.b`` another): both cannot come back as nested dicts. Records ``key``."""
    names = key.split(".")
    prefixes = [".".join(names[:i]) for i in range(1, len(names))]
    clash = next((p for p in prefixes if p in leaves), f"{key}.*" if key in inner else None)
    if clash is not None:
        raise CheckpointError(
            f"{folder}: the entries {clash!r} and {key!r} clash (one would be a value and a dict at once; "
            "torchtitan never saves both). Nothing was loaded; the step folder was edited"
        )
    leaves.add(key)
    inner.update(prefixes)


def _check_and_read(
    folder: Path,
    manifest: dict[str, Any],
    key_format: KeyFormat,
    parts: Parts,
    fresh: bool,
    group: dist.ProcessGroup | None,
    parsed: Metadata | None,
) -> tuple[dict[str, Any], list[PartState]]:
    """The load's state dict filled from the checkpoint, after every check passed on every rank;
    ``parsed``: the metadata's checked parse where the load has one already."""
    with_optimizer = parts.has_optimizer and not fresh
    states: list[PartState] = []

    def template() -> tuple[dict[str, Any], Metadata]:
        if key_format.format == 1:
            state = _by_index_state(parts, with_optimizer)
        else:
            states.extend(part_states(parts, with_optimizer))
            state = dcp_state(states)
        # parsed once for the checks and DCP's reader: 1.9 CPU s a parse at 400 entries x 256 chunks
        # (benchmarks/bench_load_metadata.py), three parses a load before
        metadata = parsed if parsed is not None else read_metadata(folder, manifest["files"])
        if "optimizer" in state:  # each lr as saved: a tensor or a float (capturable or not)
            match_lr_kinds(state["optimizer"], metadata, key_format.optim)
        return state, metadata

    read, error = attempt(template)
    raise_together(error, group, "load_checkpoint")
    assert read is not None
    state, metadata = read
    flat = _flatten(state)[0]
    everywhere = collectives.union(set(tensor_keys(flat)), group)
    groups = [g for s in states for g in s.groups]
    check = functools.partial(check_compatible, folder, metadata, flat, key_format, everywhere, groups)
    entries, error = attempt(check)  # every non-tensor entry the load reads, read once, here
    raise_together(error, group, "load_checkpoint")
    rank = collectives.rank_and_size(group)[0]
    state |= templates(manifest.get("extra", {}), rank, int(manifest.get("world_size", 1)))
    _read(SafeReader(folder, manifest["files"], metadata), state, group, entries)
    return state, states


def _by_index_state(parts: Parts, with_optimizer: bool) -> dict[str, Any]:
    """Format 1's state dict: one model and one optimizer (its groups by index)."""
    if len(parts.models) != 1:
        raise CheckpointError(
            "this checkpoint was written before 0.3.0 (param groups by index): it loads into one model "
            "and one optimizer per rank, not model parts; load it so, save it again, then load the parts"
        )
    model, optimizer = parts.pairs()[0]
    if optimizer is None or not with_optimizer:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _read(
    reader: SafeReader,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    entries: Mapping[str, Any] | None,
) -> None:
    """``dcp.load`` through the safe reader and planner. Partial: hyperparameter entries a
    torch.optim.Muon / AdamW checkpoint lacks ("algorithm") keep their current values; every tensor
    and every group was checked before. ``entries``: the non-tensor entries the checks read, put in
    as they were checked instead of read again. DCP's own failure (a BaseException) becomes a
    CheckpointError, on every rank alike, as DCP raises it."""
    planner = SafeLoadPlanner(allow_partial_load=True, read=entries)
    solo = collectives.no_process_group()
    try:
        with single_process(solo):
            dcp.load(state, storage_reader=reader, process_group=group, planner=planner, no_dist=solo)
    except CheckpointException as e:
        raise CheckpointError(f"{reader.folder}: DCP could not read the checkpoint: {e}") from e


def _apply(
    state: dict[str, Any], key_format: KeyFormat, states: list[PartState], parts: Parts, fresh: bool
) -> None:
    """Hand the loaded state to the parts (and their optimizers, unless they start fresh)."""
    if key_format.format == 2:
        apply(state, states, parts)
    else:
        model, optimizer = parts.pairs()[0]
        if optimizer is None or fresh:
            set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        else:
            keep_param_names(state["optim"], optimizer)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if fresh:
        for optimizer in parts.optimizers:
            if optimizer is not None:
                start_fresh(optimizer)


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from ..base.compat import flatten_state_dict

    return flatten_state_dict(state)
