"""A save's own temporary folder, and its publication by a rename that cannot replace or merge.

Each save writes into ``.tmp_step_XXXXXXXX_<token>``, the token a uuid4 that group rank 0 draws and
broadcasts, so two saves of one step into one root (two jobs, a retry racing a straggler) never
write into the same folder. Publication renames that folder to ``step_XXXXXXXX``: rename(2) of a
folder onto a folder that holds anything fails, so a published step is never replaced or merged
into; the save that comes second raises ``FileExistsError`` on every rank and removes its folder.
Residual race: an *empty* folder made at the final name between the check and the rename is
replaced by the checkpoint (nothing is lost; ``renameat2(RENAME_NOREPLACE)`` would close it, but is
Linux-only and not offered by every file system).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checks.together import attempt, raise_together
from . import collectives
from .manifest import complete_steps, file_record, step_dir, write_manifest

__all__ = ["IN_FLIGHT", "claim", "discarding", "prune", "publish", "rename_new"]

log = logging.getLogger(__name__)

# The final folders of this process's async saves whose wait() has not returned: their step is taken,
# and their save group is busy (a second save's collectives on it could interleave with theirs).
IN_FLIGHT: set[Path] = set()


def claim(
    root: Path, step: int, group: dist.ProcessGroup | None, asynchronous: bool = False
) -> tuple[Path, Path]:
    """Every rank checks the step is free; rank 0 makes this save's own temporary folder, whose
    name every rank then receives. One failure anywhere (the step exists or is being saved, a
    read-only or full root) raises on every rank."""
    final = step_dir(root, step)

    def make() -> str | None:
        _refuse_taken(final, asynchronous)
        if collectives.rank_and_size(group)[0] != 0:
            return None
        if final.exists():
            raise FileExistsError(
                f"{final} already exists; checkpoints are never overwritten, use a new step"
            )
        tmp = root / f".tmp_{final.name}_{uuid.uuid4().hex[:12]}"
        tmp.mkdir(parents=True)  # not exist_ok: the name is this save's alone
        return tmp.name

    name, error = attempt(make)
    raise_together(error, group, "save_checkpoint")
    return root / collectives.broadcast_object(name, group), final


def _refuse_taken(final: Path, asynchronous: bool) -> None:
    """This process's async saves in flight: their step is taken, and their group is busy."""
    if final.resolve() in IN_FLIGHT:
        raise FileExistsError(
            f"{final} is being written by an async save still in flight; checkpoints are never "
            "overwritten, use a new step"
        )
    if asynchronous and IN_FLIGHT:
        raise RuntimeError(
            f"an async save ({min(IN_FLIGHT)}) is still in flight; call its wait() before starting another"
        )


def publish(tmp: Path, final: Path, records: dict[str, dict[str, int]], info: dict[str, Any]) -> None:
    records[".metadata"] = file_record(tmp / ".metadata")
    write_manifest(tmp, records, info)
    rename_new(tmp, final)


def rename_new(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` only if ``final`` does not exist (see the module's residual race)."""
    taken = FileExistsError(
        f"{final} already exists: another save published this step while this one was written "
        "(two jobs saving into one root?); checkpoints are never overwritten, use a new step or root"
    )
    if final.exists():
        raise taken
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise taken from e
        raise


def discarding(work: Callable[[], Path], tmp: Path, group: dist.ProcessGroup | None) -> Path:
    """``work()``; if it raises (on every rank alike, so every rank has stopped writing), rank 0
    removes the save's own folder first."""
    try:
        return work()
    except BaseException:
        if collectives.rank_and_size(group)[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def prune(root: Path, keep_last: int, saved: int) -> None:
    """Delete complete steps older than the ``keep_last`` newest, never the one just saved: every
    complete step of ``root``, whichever job saved it. Each is renamed away first, so a deletion
    that stops midway never leaves a folder that looks complete. Best effort: the save is already
    published, so a failure here is logged, not raised."""
    try:
        doomed = [step_dir(root, s) for s in complete_steps(root)[:-keep_last] if s != saved]
        for folder in doomed:
            os.replace(folder, root / f".del_{folder.name}")
        for folder in root.glob(".del_step_*"):
            shutil.rmtree(folder, ignore_errors=True)
    except OSError as e:
        log.warning("keep_last=%d: could not remove older steps: %s", keep_last, e)
