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

from ..checks.together import attempt, raise_together
from ..sharding.runtime import groups
from . import collectives
from ._warnings import single_process
from .arguments_agree import agree_save
from .extra_tensors import rank_entries, split_tensors
from .holders import check_holders, describe_entries
from .keys import PER_FQN, Models, Optimizers, Parts, dcp_state, optimizer_types, part_states
from .manifest import CheckpointError, check_extra, complete_steps, file_record
from .publish import IN_FLIGHT, claim, discarding, prune, publish

__all__ = [
    "CheckpointError",
    "PendingSave",
    "async_save_checkpoint",
    "complete_steps",
    "save_checkpoint",
]

log = logging.getLogger(__name__)


def _saved_state(model: Models, optimizer: Optimizers) -> tuple[dict[str, Any], dict[str, str]]:
    """What a save writes (format 2, ``keys``): the rank's parts by FQN, their optimizers' entries
    per parameter; and what each model entry is (``holders``). Local: ValueError for parts that do
    not pair up or share an entry."""
    parts = Parts.of(model, optimizer)
    state = dcp_state(part_states(parts, with_optimizer=True))
    return state, describe_entries(state, parts)


def _extra_entries(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> dict[str, Any]:
    return rank_entries(tensors, collectives.rank_and_size(group)[0])


def _check_arguments(
    step: int, extra: Any, keep_last: int | None, model: Models, optimizer: Optimizers
) -> tuple[dict[str, Any], tuple[dict[str, Any], dict[str, str]]]:
    """Local checks, before any collective or file write: the manifest's ``extra``, the state and
    its entries' descriptions."""
    if type(step) is not int or step < 0:
        raise ValueError(f"step should be an int of at least 0 but is {step!r}")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise ValueError(f"keep_last should be None or an int of at least 1 but is {keep_last!r}")
    return check_extra(extra), _saved_state(model, optimizer)


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
            "format": PER_FQN.format,
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
    model: Models,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """Save model (and optimizer) state of ``step`` under ``root``; collective over the group.

    ``model`` and ``optimizer`` may be lists, one optimizer per model part (pipeline stages,
    torchtitan's ``model_parts``), and ranks may hold different parts: entries are keyed per
    parameter FQN (torchtitan's keys), so the checkpoint loads on any stage layout. Every rank
    writes only its own shards.

    ``extra`` (JSON values that come back unchanged: data position, RNG seeds, ...; see
    ``check_extra``) is stored in the manifest and returned by ``load_checkpoint``. An existing
    step is never overwritten; ``keep_last`` (None or at least 1) deletes older complete steps. Any
    failure raises the same error on every rank, and leaves no half-published step.
    """
    given, (extra, (saved, described)) = extra, agree_save(
        process_group, lambda: _check_arguments(step, extra, keep_last, model, optimizer),
        root=str(root), step=step, extra=extra, keep_last=keep_last,
        optimizer=optimizer_types(optimizer),
    )  # fmt: skip
    check_holders(described, process_group, "save_checkpoint")
    tmp, final = claim(Path(root), step, process_group)
    solo = collectives.no_process_group()
    tensors = split_tensors(given)[1]

    def write_and_publish() -> Path:  # DCP's errors and _finalize's reach every rank alike
        with single_process(solo):
            state = saved | _extra_entries(tensors, process_group)
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
    model: Models,
    optimizer: Optimizers = None,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Like ``save_checkpoint``, but returns once the state is staged; training may go on. Call
    ``wait()`` on the result (every rank) before the next async save and before exiting; a save of
    the same step, or another async save, before then raises on every rank."""
    given, (extra, (saved, described)) = extra, agree_save(
        process_group, lambda: _check_arguments(step, extra, keep_last, model, optimizer),
        "async_save_checkpoint", root=str(root), step=step, extra=extra, keep_last=keep_last,
        optimizer=optimizer_types(optimizer),
    )  # fmt: skip
    check_holders(described, process_group, "async_save_checkpoint")
    tmp, final = claim(Path(root), step, process_group, asynchronous=True)
    group = groups.save_group(process_group)
    state = saved | _extra_entries(split_tensors(given)[1], process_group)
    future = dcp.async_save(
        state, checkpoint_id=str(tmp), process_group=group, no_dist=collectives.no_process_group()
    )
    return PendingSave(
        future,
        lambda: discarding(lambda: _finalize(tmp, final, step, extra, keep_last, group), tmp, group),
        final.resolve(),
    )
