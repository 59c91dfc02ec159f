"""What a rank that raised inside a step's data path tells the others, through the job's default
store: peers blocked in a host collective of the step that this rank will never join raise instead of
waiting for the process group's timeout (gloo has no abort that closes a live process's connections).
``comm.py``'s host collectives wait through ``wait_released``."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...base.torch_dist import default_group, default_store

__all__ = ["FAILED_KEY", "job_failure", "releasing_peers", "report_failure", "wait_released"]


# Where a rank that raised inside a step tells the others (the job's default store), and how often a
# rank blocked in one of the step's host collectives looks there.
FAILED_KEY = "muon_dtensor/step_failed"
POLL = datetime.timedelta(seconds=0.5)


@contextlib.contextmanager
def releasing_peers() -> Iterator[None]:
    """Around a step's data path: an exception leaving it is reported to every rank of the job, so
    peers blocked in a collective that this rank will never join raise instead of waiting for the
    process group's timeout (gloo has no abort that closes the connections of a live process)."""
    try:
        yield
    except BaseException as e:
        report_failure(e)
        _remember(
            _first_failure()
            or f"rank {dist.get_rank() if dist.is_initialized() else 0} raised {type(e).__name__}: {e}"
        )
        raise


# The failure this process saw inside a step's data path, with the default group it happened under:
# ``job_failure`` answers for that group only, so a re-created process group starts clean.
_FAILED: list[tuple[Any, str]] = []


def _remember(text: str) -> None:
    if dist.is_available() and dist.is_initialized() and not _FAILED:
        _FAILED.append((default_group(), text[:2000]))


def _first_failure() -> str | None:
    """The job's first recorded failure (the store's), or None; best effort."""
    try:
        store = _store()
        if store is not None and store.check([FAILED_KEY]):
            return str(store.get(FAILED_KEY).decode(errors="replace"))
    except Exception:  # noqa: BLE001 - the store may have died with the failing rank
        pass
    return None


def job_failure() -> str | None:
    """The step failure this process saw (its own, or a peer's that released it), if it happened
    under the current default process group; else None. Local: no collective."""
    if not _FAILED or not (dist.is_available() and dist.is_initialized()):
        return None
    group, text = _FAILED[-1]
    if group is not default_group():
        _FAILED.clear()
        return None
    return text


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return default_store()


def report_failure(error: BaseException) -> None:
    """Record the first failure in the job's store; best effort (the store may have died too)."""
    try:
        store = _store()
        if store is not None and not store.check([FAILED_KEY]):
            store.set(FAILED_KEY, f"rank {dist.get_rank()} raised {type(error).__name__}: {error}"[:2000])
    except Exception:  # noqa: BLE001 - reporting must not hide the error being raised
        pass


def wait_released(work: Any, device: torch.device) -> None:
    """``work.wait()``; for host collectives in slices of ``POLL``, between which a failure another
    rank reported (``releasing_peers``) raises here. A device collective waits as before (under
    NCCL, its watchdog bounds a wait). A failure of the collective itself is reported too."""
    store = _store() if device.type == "cpu" else None
    if store is None:
        work.wait()
        return
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            if work.is_completed():  # failed, or done just after the slice ran out
                _wait_reporting(work)
                return
        if store.check([FAILED_KEY]):
            _remember(store.get(FAILED_KEY).decode(errors="replace"))
            raise RuntimeError(
                f"{store.get(FAILED_KEY).decode(errors='replace')} inside Muon.step; this rank was "
                "waiting for it in a collective of the step and stops. The ranks' states now differ: "
                "restart from the last complete checkpoint"
            )


def _wait_reporting(work: Any) -> None:
    try:
        work.wait()
    except BaseException as e:
        report_failure(e)
        raise
