"""One-call checkpoints on top of torch.distributed.checkpoint (DCP): step folders, atomic
publication, checksums, keep-last-k, newest-complete resume.

Layout of ``root``::

    step_00000100/        published: DCP files + manifest.json (checksums, extra state)
    .tmp_step_00000200/   being written (or left by a crash): never loaded, replaced on retry

Every rank writes its own shards through DCP (no gather). After all ranks finished, each reports
the checksums of the files it wrote, rank 0 writes the manifest and renames the folder to its final
name; only then does the checkpoint exist. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from .._sharding import comm
from ._warnings import single_process
from .manifest import (
    CheckpointError,
    check_compatible,
    complete_steps,
    file_record,
    read_manifest,
    step_dir,
    verify_files,
    write_manifest,
)

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


def _publish(tmp: Path, final: Path, records: dict[str, dict[str, int]], info: dict[str, Any]) -> None:
    records[".metadata"] = file_record(tmp / ".metadata")
    write_manifest(tmp, records, info)
    os.replace(tmp, final)


def _prepare(root: Path, step: int, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    final = step_dir(root, step)
    tmp = root / f".tmp_{final.name}"
    if comm.broadcast_object(final.exists(), group):
        raise FileExistsError(f"{final} already exists; checkpoints are never overwritten, use a new step")
    if comm.rank_and_size(group)[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed earlier attempt left
        tmp.mkdir(parents=True)
    comm.barrier(group)
    return tmp, final


def _finalize(
    tmp: Path,
    final: Path,
    step: int,
    extra: dict[str, Any] | None,
    keep_last: int | None,
    group: dist.ProcessGroup | None,
) -> Path:
    """Checksums from every rank, then rank 0 publishes: manifest, rename, prune."""
    rank, world = comm.rank_and_size(group)
    mine = {p.name: file_record(p) for p in tmp.glob(f"__{rank}_*.distcp")}
    records = {k: v for part in comm.gather_objects(mine, group) for k, v in part.items()}
    if rank == 0:
        info = {
            "step": step,
            "extra": extra or {},
            "world_size": world,
            "time": time.time(),
            "torch": torch.__version__,
        }
        _publish(tmp, final, records, info)
        if keep_last is not None:
            for old in complete_steps(final.parent)[:-keep_last]:
                shutil.rmtree(step_dir(final.parent, old), ignore_errors=True)
    comm.barrier(group)
    log.info("saved %s (%d files)", final, len(records) + 1)
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

    ``extra`` (JSON-serializable: data position, RNG seeds, ...) is stored in the manifest and
    returned by ``load_checkpoint``. An existing step is never overwritten.
    """
    tmp, final = _prepare(Path(root), step, process_group)
    solo = _solo()
    with single_process(solo):
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp), process_group=process_group, no_dist=solo)
    return _finalize(tmp, final, step, extra, keep_last, process_group)


class PendingSave:
    """An asynchronous save in flight. ``wait()`` (collective: call it on every rank) blocks until
    every rank's files are written, then publishes the checkpoint and returns its folder."""

    def __init__(self, future: Any, publish: Callable[[], Path]) -> None:
        self._future, self._publish = future, publish
        self._done: Path | None = None

    def wait(self) -> Path:
        if self._done is None:
            self._future.result()
            self._done = self._publish()
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
    ``wait()`` on the result (every rank) before the next save and before exiting."""
    group = comm.save_group(process_group)
    tmp, final = _prepare(Path(root), step, group)
    future = dcp.async_save(
        _state(model, optimizer), checkpoint_id=str(tmp), process_group=group, no_dist=_solo()
    )
    return PendingSave(future, lambda: _finalize(tmp, final, step, extra, keep_last, group))


def latest_step(root: str | os.PathLike) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def _verify(folder: Path, group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Every rank checks a share of the files; every rank raises the same error naming them."""
    rank, world = comm.rank_and_size(group)
    manifest = read_manifest(folder)
    names = sorted(manifest["files"])
    problems = verify_files(folder, names[rank::world], manifest)
    everyone = sorted(p for part in comm.gather_objects(problems, group) for p in part)
    if everyone:
        raise CheckpointError("checkpoint files failed verification: " + "; ".join(everyone))
    return manifest


def load_checkpoint(
    root: str | os.PathLike,
    model: nn.Module,
    optimizer: Optimizer | None = None,
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Load ``step`` (default: the newest complete one) into ``model`` and ``optimizer``.

    Returns ``{"step": ..., **extra}``, or None when ``root`` holds no complete checkpoint. The
    world size and mesh may differ from the saving run's: DCP reshards. Files are verified against
    their checksums and the checkpoint's tensors against the model's before anything is loaded.
    """
    chosen = comm.broadcast_object(step if step is not None else latest_step(root), process_group)
    if chosen is None:
        return None
    folder = step_dir(root, chosen)
    manifest = _verify(folder, process_group)
    state = _state(model, optimizer)
    flat, _ = _flatten(state)
    check_compatible(folder, flat)
    # Partial load: hyperparameter entries a torch.optim.Muon / AdamW checkpoint lacks ("algorithm")
    # keep their current values; every tensor was checked to be present above.
    planner = DefaultLoadPlanner(allow_partial_load=True)
    solo = _solo()
    with single_process(solo):
        dcp.load(state, checkpoint_id=str(folder), process_group=process_group, planner=planner, no_dist=solo)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"step": chosen, **manifest.get("extra", {})}


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)
