"""One-call checkpoints on top of torch.distributed.checkpoint (DCP): step folders, atomic
publication, checksums, keep-last-k, newest-complete resume.

Layout of ``root``::

    step_00000100/        published: DCP files + manifest.json (checksums, extra state)
    .tmp_step_00000200_<token>/  being written by one save (its own, see ``publish``): never loaded
    .del_step_00000050/   being deleted by keep_last: never loaded

Every rank writes its own shards through DCP (no gather). After all ranks finished, each reports
the checksums of the files it wrote, rank 0 writes the manifest and renames the folder to its final
name; only then does the checkpoint exist. The folder must be on a file system every rank sees.

A save or load never leaves a rank waiting in a collective for one that failed: arguments are
checked locally before any collective; a step of rank 0's own file work (making the folder,
publishing) ends in ``checks.together.raise_together``, so every rank raises the same error; DCP's own failures
already reach every rank. A load checks files, tensors and param groups before it changes anything.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from ..checks.together import attempt, raise_together
from ..sharding.runtime import groups
from . import collectives
from ._fresh import check_optimizer_state, keep_param_names, start_fresh, unwrapped_param_names
from ._warnings import single_process
from .agree import agree, agree_save
from .extra_tensors import fill, rank_entries, split_tensors, templates
from .manifest import (
    MANIFEST,
    CheckpointError,
    check_compatible,
    check_extra,
    complete_steps,
    file_record,
    read_manifest,
    step_dir,
    verify_files,
)
from .publish import IN_FLIGHT, claim, discarding, prune, publish
from .safe_read import SafeLoadPlanner, SafeReader

__all__ = [
    "CheckpointError",
    "PendingSave",
    "async_save_checkpoint",
    "complete_steps",
    "latest_step",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)


def _solo() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _saved_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """What a save writes: DCP's state, with parameter names free of wrapper components too."""
    state = _state(model, optimizer)
    unwrapped_param_names(state.get("optim", {}))
    return state


def _extra_entries(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, Any]:
    return rank_entries(tensors, collectives.rank_and_size(group)[0])


def _check_arguments(step: int, extra: Any, keep_last: int | None) -> dict[str, Any]:
    """Local checks, the same on every rank, before any collective or file write."""
    if type(step) is not int or step < 0:
        raise ValueError(f"step should be an int of at least 0 but is {step!r}")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError(f"keep_last should be None or an int of at least 1 but is {keep_last!r}")
    return check_extra(extra)


def _finalize(
    tmp: Path,
    final: Path,
    step: int,
    extra: dict[str, Any],
    keep_last: int | None,
    group: dist.ProcessGroup | None,
) -> Path:
    """Checksums from every rank, then rank 0 publishes: manifest, rename, prune. A failure on any
    rank (a file that cannot be read back, a full disk, a read-only root) raises on every rank."""
    rank, world = collectives.rank_and_size(group)
    mine, error = attempt(lambda: {p.name: file_record(p) for p in tmp.glob(f"__{rank}_*.distcp")})
    raise_together(error, group, "save_checkpoint")
    parts = collectives.gather_objects(mine, group)
    if rank == 0:
        records = {k: v for part in parts for k, v in part.items()}
        info = {
            "step": step,
            "extra": extra,
            "world_size": world,
            "time": time.time(),
            "torch": torch.__version__,
        }
        error = attempt(lambda: publish(tmp, final, records, info))[1]
        if error is None and keep_last is not None:
            prune(final.parent, keep_last, step)
    raise_together(error, group, "save_checkpoint")
    if rank == 0:  # one line per save, not one per rank
        log.info("saved %s", final)
    return final


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save model (and optimizer) state of ``step`` under ``root``; collective over the group.

    ``extra`` (JSON values that come back unchanged: data position, RNG seeds, ...; see
    ``check_extra``) is stored in the manifest and returned by ``load_checkpoint``. An existing
    step is never overwritten; ``keep_last`` (None or at least 1) deletes older complete steps. Any
    failure raises the same error on every rank, and leaves no half-published step.
    """
    given, extra = extra, agree_save(
        model, optimizer, process_group, lambda: _check_arguments(step, extra, keep_last),
        root=str(root), step=step, extra=extra, keep_last=keep_last,
    )  # fmt: skip
    tmp, final = claim(Path(root), step, process_group)
    solo = _solo()
    tensors = split_tensors(given)[1]

    def write_and_publish() -> Path:  # DCP's errors and _finalize's reach every rank alike
        with single_process(solo):
            state = _saved_state(model, optimizer) | _extra_entries(tensors, process_group)
            dcp.save(state, checkpoint_id=str(tmp), process_group=process_group, no_dist=solo)
        return _finalize(tmp, final, step, extra, keep_last, process_group)

    return discarding(write_and_publish, tmp, process_group)


class PendingSave:
    """An asynchronous save in flight. ``wait()`` (collective: call it on every rank) blocks until
    every rank's files are written, then publishes the checkpoint and returns its folder; a failure
    raises on every rank, and again on a later ``wait()``."""

    def __init__(self, future: Any, publish: Callable[[], Path], final: Path) -> None:
        self._future, self._publish, self._final = future, publish, final
        self._done: Path | None = None
        self._error: BaseException | None = None
        IN_FLIGHT.add(final)

    def wait(self) -> Path:
        if self._error is not None:
            raise self._error
        if self._done is None:
            try:
                self._future.result()
                self._done = self._publish()
            except BaseException as e:
                self._error = e
                raise
            finally:
                IN_FLIGHT.discard(self._final)
        return self._done


def async_save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Like ``save_checkpoint``, but returns once the state is staged; training may go on. Call
    ``wait()`` on the result (every rank) before the next async save and before exiting; a save of
    the same step, or another async save, before then raises on every rank."""
    given, extra = extra, agree_save(
        model, optimizer, process_group, lambda: _check_arguments(step, extra, keep_last),
        "async_save_checkpoint", root=str(root), step=step, extra=extra, keep_last=keep_last,
    )  # fmt: skip
    tmp, final = claim(Path(root), step, process_group, asynchronous=True)
    group = groups.save_group(process_group)
    state = _saved_state(model, optimizer) | _extra_entries(split_tensors(given)[1], process_group)
    future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=_solo())
    return PendingSave(
        future,
        lambda: discarding(lambda: _finalize(tmp, final, step, extra, keep_last, group), tmp, group),
        final.resolve(),
    )


def latest_step(root: str | os.PathLike) -> int | None:
    """The newest published step under ``root``, or None; CheckpointError if ``root`` is a step
    folder, or if the newest step's manifest fails its checks (the load would refuse it)."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        raise CheckpointError(
            f"{root} is a step folder, not a checkpoint root; pass its parent {root.parent} (and step=...)"
        )
    steps = complete_steps(root)
    if not steps:
        return None
    read_manifest(step_dir(root, steps[-1]))
    return steps[-1]


def _verify(folder: Path, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank checks a share of the files; every rank raises the same error naming them."""
    rank, world = collectives.rank_and_size(group)

    def check() -> tuple[dict[str, Any], list[str]]:
        manifest = read_manifest(folder)
        return manifest, verify_files(folder, sorted(manifest["files"])[rank::world], manifest)

    def checked() -> dict[str, Any]:
        manifest, problems = check()
        if problems:
            raise CheckpointError("checkpoint files failed verification: " + "; ".join(sorted(problems)))
        return manifest

    manifest, error = attempt(checked)
    raise_together(error, group, "load_checkpoint")
    assert manifest is not None
    return manifest


def load_checkpoint(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    step: int | None = None,
    optimizer_state: str = "load",
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Load ``step`` (default: the newest complete one) into ``model`` and ``optimizer``.

    Returns ``{"step": ..., **extra}``, or None when ``root`` holds no complete checkpoint. The
    world size and mesh may differ from the saving run's: DCP reshards. Before anything is loaded,
    files are verified against their checksums, the checkpoint's tensors against the model's and
    its param groups against the optimizer's; a failure raises on every rank. ``optimizer_state``:
    ``"load"`` (default) loads the optimizer's state and refuses a checkpoint without it;
    ``"fresh"`` loads the weights alone and restarts ``optimizer`` (zero momentum, step 0), as when
    switching from another optimizer. Whether an optimizer is passed (and its type),
    ``optimizer_state`` and ``step`` must be the same on every rank: a difference raises on every
    rank, naming the argument, before anything is read.
    """
    fresh = agree(
        "load_checkpoint",
        process_group,
        lambda: (check_optimizer_state(optimizer_state, optimizer), {}),
        optimizer=None if optimizer is None else type(optimizer).__qualname__,
        optimizer_state=optimizer_state,
        step=step,
        root=str(root),
    )
    chosen, error = collectives.broadcast_object(
        attempt(lambda: step if step is not None else latest_step(root)), process_group
    )
    if error is not None:
        raise error
    if chosen is None:
        return None
    folder = step_dir(root, chosen)
    manifest = _verify(folder, process_group)
    state = _state(model, None if fresh else optimizer)
    raise_together(
        attempt(lambda: check_compatible(folder, _flatten(state)[0]))[1], process_group, "load_checkpoint"
    )
    rank = collectives.rank_and_size(process_group)[0]
    state |= templates(manifest.get("extra", {}), rank, int(manifest.get("world_size", 1)))
    _read(folder, manifest["files"], state, process_group)
    _apply(state, model, optimizer, fresh)
    if fresh and collectives.rank_and_size(process_group)[0] == 0:
        log.warning(
            "load_checkpoint(optimizer_state='fresh'): loaded the model weights of %s; the optimizer "
            "starts fresh (zero momentum, step 0), the checkpoint's optimizer state (if any) is not used",
            folder,
        )
    return {"step": chosen, **fill(manifest.get("extra", {}), state)}


def _read(folder: Path, files: list[str], state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """``dcp.load`` through the safe reader and planner. Partial: hyperparameter entries a
    torch.optim.Muon / AdamW checkpoint lacks ("algorithm") keep their current values; every tensor
    and every group was checked before. DCP's own failure (a BaseException) becomes a
    CheckpointError, on every rank alike, as DCP raises it."""
    reader, planner = SafeReader(folder, files), SafeLoadPlanner(allow_partial_load=True)
    solo = _solo()
    try:
        with single_process(solo):
            dcp.load(state, storage_reader=reader, process_group=group, planner=planner, no_dist=solo)
    except CheckpointException as e:
        raise CheckpointError(f"{folder}: DCP could not read the checkpoint: {e}") from e


def _apply(state: dict[str, Any], model: nn.Module, optimizer: Optimizer | None, fresh: bool) -> None:
    """Hand the loaded state to the model (and the optimizer, unless it starts fresh)."""
    if optimizer is None or fresh:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        if optimizer is not None:
            start_fresh(optimizer)
        return
    keep_param_names(state["optim"], optimizer)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from ..sharding.plan.compat import flatten_state_dict

    return flatten_state_dict(state)
