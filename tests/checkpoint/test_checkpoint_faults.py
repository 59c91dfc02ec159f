"""Checkpoint saves that fail and loads that must not start, on 2 ranks: a full disk at any byte, a
read-only root, a step that is taken, a step whose async save is in flight, param groups split or
ordered otherwise. Every rank raises the same error within the call's deadline (seconds, where a rank
used to wait forever), the root keeps the previous complete checkpoint and nothing half-published,
and a refused load leaves the model and the optimizer untouched.

Disk faults are simulated in processes of their own by metering this process's writes under the
checkpoint root (``_Disk``), so the tests need no mount or root rights: background jobs on pools the
session's zygote forks and closes after the call (``background.apart``), beside the session's tests.
The rest runs in the pooled ranks of ``tests.harness.ranks``.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.checks.together import raise_together
from tests.harness import background
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, full, model_grads, step_together

TIMEOUT = 90.0  # seconds per call: fresh processes start in a few; a hang is what this catches
SAMPLE = 2  # faults drawn for the fast tier's full-disk test, besides the first and the last
Outcome = tuple[str, str]  # (exception type or "ok", message)


# ----------------------------------------------------------------------------------- disk faults


class _Disk:
    """This process's writes under ``root``, metered per file, in the order the files are opened
    (``sizes``). ``fail(k, o)`` makes the disk full once file ``k`` holds ``o`` bytes (``o = -1``: one
    byte short of the end of the write that reaches it, the manifest's single write; ``k = -1``: full
    from the start): the write that crosses it writes what fits and raises ENOSPC, as does every
    later write or mkdir. ``read_only`` refuses every write-open, mkdir and rename under ``root``
    with EROFS. Patches ``open``, ``io.open`` (pathlib's), ``os.mkdir``, ``os.rename`` and
    ``os.replace`` for the rest of the process."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.read_only = False
        self.fail()
        self.real = (builtins.open, os.mkdir, os.replace)
        self.rename_before = os.rename
        builtins.open = io.open = self.open
        os.mkdir = self.mkdir
        os.rename = os.replace = self.rename

    def close(self) -> None:
        """Put back what ``__init__`` patched."""
        builtins.open = io.open = self.real[0]
        os.mkdir, os.replace, os.rename = self.real[1], self.real[2], self.rename_before

    def fail(self, at: tuple[int, int] | None = None) -> None:
        """Start metering a save: no fault (None), or full at ``at``."""
        self.sizes: list[int] = []
        self.at, self.full = at, at is not None and at[0] < 0

    def mine(self, path: Any) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.realpath(path).startswith(self.root)

    def refuse(self, path: Any, when_full: bool = False) -> None:
        if self.mine(path) and self.read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        if self.mine(path) and when_full and self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        writing = any(c in mode for c in "wax+")
        if writing:
            self.refuse(file)
        f = self.real[0](file, mode, *args, **kwargs)
        if not (writing and self.mine(file)):
            return f
        self.sizes.append(0)
        return _Metered(f, self, len(self.sizes) - 1)

    def mkdir(self, path: Any, *args: Any, **kwargs: Any) -> None:
        self.refuse(path, when_full=True)
        self.real[1](path, *args, **kwargs)

    def rename(self, src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        self.refuse(src)
        self.real[2](src, dst, *args, **kwargs)

    def take(self, k: int, n: int) -> int:
        """How many of ``n`` bytes written to file ``k`` fit; they count as written."""
        room = 0 if self.full else n
        if self.at is not None and self.at[0] == k and not self.full:
            limit = self.at[1] if self.at[1] >= 0 else self.sizes[k] + n + self.at[1]
            room = max(0, min(n, limit - self.sizes[k]))
            self.full = room < n
        self.sizes[k] += room
        return room


class _Metered:
    """File ``k`` of a ``_Disk``: its writes go through ``_Disk.take``."""

    def __init__(self, f: Any, disk: _Disk, k: int) -> None:
        self._f, self._disk, self._k = f, disk, k

    def write(self, data: Any) -> int:
        raw = data.encode() if isinstance(data, str) else memoryview(data).cast("B")
        room = self._disk.take(self._k, len(raw))
        if room < len(raw):
            if room:
                self._f.write(data[:room] if isinstance(data, str) else raw[:room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Metered:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@pytest.mark.slow
def test_a_full_disk_at_any_byte_raises_on_every_rank_and_keeps_the_last_checkpoint(
    full_disk_on_each_rank: list[list[dict[str, Any]]],
) -> None:
    """Each rank's disk fills in turn: before the save, at the first, second, middle and last byte
    of every file it writes (its shard; on rank 0 also DCP's .metadata and the manifest, whose last
    byte is the very end of the save) and at 7 more points of its shard. The default tier runs a
    sample of these (the next test)."""
    folder, both = background.folder("full_disk_on_each_rank"), full_disk_on_each_rank
    for who in (0, 1):
        root = folder / f"rank{who}_full"
        results = [per_rank[who] for per_rank in both]
        faults = results[0]["faults"]
        files = 3 if who == 0 else 1  # rank 0: shard, .metadata, manifest; rank 1: its shard
        assert {k for k, _ in faults} == {-1, *range(files)} and len(faults) >= 4 * files + 7, faults
        assert who == 1 or (2, -1) in faults, faults  # rank 0: the last byte of the save
        _check_full_disk(root, who, results)


@pytest.mark.sample_of("test_a_full_disk_at_any_byte_raises_on_every_rank_and_keeps_the_last_checkpoint")
def test_a_full_disk_at_sampled_bytes_raises_on_every_rank_and_keeps_the_last_checkpoint(
    full_disk_sampled: list[list[dict[str, Any]]],
) -> None:
    """The fast tier's share of the test above: rank 0's disk (it writes the shard, .metadata and the
    manifest) fills before the save, at the save's last byte and at 2 of the other points, drawn
    with a fixed seed; the same checks on each."""
    root = background.folder("full_disk_sampled") / "rank0_full"
    results = [per_rank[0] for per_rank in full_disk_sampled]
    faults = results[0]["faults"]
    assert len(faults) == SAMPLE + 2 and (-1, 0) in faults and (2, -1) in faults, faults
    _check_full_disk(root, 0, results)


def _check_full_disk(root: Path, who: int, results: list[dict[str, Any]]) -> None:
    """Every fault raised the same error on both ranks and kept step 1; then a retry saved step 2."""
    for i, fault in enumerate(results[0]["faults"]):
        seen = [r["outcomes"][i] for r in results]
        assert seen[0] == seen[1], (who, fault, seen)
        # OSError from our own steps (the folder, the manifest), CheckpointException from DCP's
        # (torch.save can turn the ENOSPC into "unexpected pos" in its zip writer).
        assert seen[0][0] in ("OSError", "CheckpointException"), (who, fault, seen[0])
        assert results[0]["complete"][i] == [1], (who, fault, results[0]["complete"][i])
    assert all(r["retry"] == ("ok", "") and r["resumed"] for r in results), results
    assert ckpt.complete_steps(root) == [1, 2]


@pytest.mark.slow
def test_a_read_only_root_raises_on_every_rank(read_only_root: list[dict[str, Any]]) -> None:
    folder, results = background.folder("read_only_root"), read_only_root
    assert results[0]["outcome"] == results[1]["outcome"], results
    kind, message = results[0]["outcome"]
    assert kind == "OSError" and "Read-only file system" in message and ".tmp_step_00000002" in message
    assert results[0]["complete"] == [1] and not (folder / "step_00000002").exists()


# ----------------------------------------------------------------------------------- taken steps


def test_saving_a_step_twice_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(same_step_twice, 2, str(tmp_path), timeout=TIMEOUT)
    assert results[0] == results[1], results
    for kind, message in results[0]:
        assert kind == "FileExistsError" and "step_00000004 already exists" in message, message


def test_a_step_whose_async_save_is_in_flight_is_refused(tmp_path: Path) -> None:
    results = run_ranks(while_async_in_flight, 2, str(tmp_path), timeout=TIMEOUT)
    assert results[0] == results[1], results
    same_sync, same_async, other_async, published, same_state = results[0]
    assert same_sync[0] == same_async[0] == "FileExistsError" and "still in flight" in same_sync[1]
    assert other_async[0] == "RuntimeError" and "call its wait() before starting another" in other_async[1]
    assert published == [4] and same_state


# ----------------------------------------------------------------------------------- refused loads


@pytest.mark.parametrize("how", ["split", "reordered"])
def test_any_grouping_of_the_same_parameters_loads(tmp_path: Path, how: str) -> None:
    """Settings and state are keyed per parameter FQN: groups cut at another layer, or in another
    order, load each parameter's own saved state and settings."""
    for kind, message, _, loaded in run_ranks(load_other_groups, 2, str(tmp_path), how, timeout=TIMEOUT):
        assert kind == "ok", message
        assert loaded


def test_a_group_whose_parameters_were_saved_with_other_settings_changes_nothing(tmp_path: Path) -> None:
    """A group takes one learning rate: parameters saved with two are refused before any load."""
    for kind, message, untouched, _ in run_ranks(
        load_other_groups, 2, str(tmp_path), "split_lr", timeout=TIMEOUT
    ):
        assert kind == "CheckpointError" and "param groups are not the checkpoint's" in message, message
        assert (
            "group 1 takes one lr, but it was saved as 0.02 for layers.2.weight and 0.01 for layers.3.weight"
            in message
        ), message
        assert untouched


def test_raise_together_hands_every_rank_the_same_exception() -> None:
    """The primitive every failure above goes through (``checks.together.raise_together``): the
    first failing rank's exception on every rank,
    as a RuntimeError with its text when it cannot be pickled; None when no rank failed."""
    for rank, seen in enumerate(run_ranks(first_errors, 2, timeout=TIMEOUT)):
        assert seen[0] == ("OSError", "[Errno 28] No space left on device: 'x'", rank == 0), seen
        assert seen[1] == ("RuntimeError", "_Unpicklable: no pickle", False), seen
        assert seen[2] is None


# --------------------------------------------------------------- rank functions (module level, typed)


def _trained(seed: int = 0, groups: Callable[[nn.Module], list[dict[str, Any]]] = split_params) -> Any:
    """An FSDP ``Net`` over every rank and its optimizer, after one step."""
    model = build((dist.get_world_size(),), seed=seed)
    opt = Muon(groups(model), lr=0.02)
    step_together([(list(model.parameters()), opt)], model_grads(model, 100), range(1))
    return model, opt


def _outcome(work: Callable[[], Any]) -> Outcome:
    try:
        work()
    except BaseException as e:  # noqa: BLE001 - the error is the result (DCP's CheckpointException too)
        return type(e).__name__, str(e)
    return "ok", ""


def _snapshot(model: nn.Module, opt: Muon) -> dict[str, Any]:
    out: dict[str, Any] = {f"param:{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"{k}:{n}": full(v).clone() for k, v in opt.state[p].items()})
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items()
    )


def _faults(sizes: list[int], manifest_last: bool) -> list[tuple[int, int]]:
    """Where to fill the disk, given the sizes of the files a save writes here, in order. With
    ``manifest_last`` the last file is the manifest, whose size varies by a byte or two between saves
    (the time, the checksums): its end is ``-1``, one byte short of its single write, the save's end."""
    at = {(-1, 0)}
    for k, size in enumerate(sizes):
        at |= {(k, 0), (k, 1), (k, size // 2)}
        at |= {(k, -1 if manifest_last and k == len(sizes) - 1 else size - 1)}
    shard = max(range(len(sizes)), key=sizes.__getitem__)
    return sorted(at | {(shard, sizes[shard] * j // 8) for j in range(1, 8)})


def full_disks(folder: str, whos: list[int], sample: int | None = None) -> list[dict[str, Any]]:
    """``full_disk`` for each rank of ``whos`` in turn, each under its own root in ``folder``."""
    return [full_disk(f"{folder}/rank{who}_full", who, sample) for who in whos]


# Their folders are the jobs' own (``background.folder``), kept until the session ends.
full_disk_on_each_rank = background.apart(
    "full_disk_on_each_rank", full_disks, 2, [0, 1], timeout=2 * TIMEOUT, in_folder=True
)
full_disk_sampled = background.apart(
    "full_disk_sampled", full_disks, 2, [0], SAMPLE, timeout=TIMEOUT, in_folder=True
)


def full_disk(root: str, who: int, sample: int | None = None) -> dict[str, Any]:
    """Step 1 is saved; then rank ``who``'s disk fills at each fault while step 2 is saved (with
    ``sample``: the first and last fault and ``sample`` others, drawn with a fixed seed)."""
    model, opt = _trained()
    ckpt.save_checkpoint(root, 1, model, opt)
    at_one = _snapshot(model, opt)
    disk = _Disk(root)
    ckpt.save_checkpoint(root, 2, model, opt)  # a probe: what this rank writes for this save
    faults = _faults(disk.sizes, manifest_last=who == 0)
    if sample is not None:
        last = len(disk.sizes) - 1  # full from the start, and at the last byte of the last file
        ends = [(-1, 0), (last, -1 if who == 0 else disk.sizes[last] - 1)]
        faults = sorted(ends + random.Random(0).sample([f for f in faults if f not in ends], sample))
    box: list[Any] = [faults]
    dist.broadcast_object_list(box, src=who)
    if dist.get_rank() == 0:
        shutil.rmtree(f"{root}/step_00000002")
    dist.barrier()
    outcomes, complete = [], []
    for fault in box[0]:
        disk.fail(fault if dist.get_rank() == who else None)
        outcomes.append(_outcome(lambda: ckpt.save_checkpoint(root, 2, model, opt)))
        complete.append(ckpt.complete_steps(root))
    disk.fail()
    retry = _outcome(lambda: ckpt.save_checkpoint(root, 2, model, opt))
    fresh, fresh_opt = _trained(seed=5)
    ckpt.load_checkpoint(root, fresh, fresh_opt, step=1)
    resumed = _same(_snapshot(fresh, fresh_opt), at_one)
    disk.close()
    return {"faults": box[0], "outcomes": outcomes, "complete": complete, "retry": retry, "resumed": resumed}


def read_only(root: str) -> dict[str, Any]:
    model, opt = _trained()
    ckpt.save_checkpoint(root, 1, model, opt)
    _Disk(root).read_only = True
    outcome = _outcome(lambda: ckpt.save_checkpoint(root, 2, model, opt))
    return {"outcome": outcome, "complete": ckpt.complete_steps(root)}


read_only_root = background.apart("read_only_root", read_only, 2, timeout=TIMEOUT, in_folder=True)


def same_step_twice(root: str) -> list[Outcome]:
    model, opt = _trained()
    ckpt.save_checkpoint(root, 4, model, opt)
    again = _outcome(lambda: ckpt.save_checkpoint(root, 4, model, opt))
    again_async = _outcome(lambda: ckpt.async_save_checkpoint(root, 4, model, opt).wait())
    return [again, again_async]


def while_async_in_flight(root: str) -> tuple[Outcome, Outcome, Outcome, list[int], bool]:
    """While step 4's async save is in flight: step 4 again (sync, async), another async save."""
    model, opt = _trained()
    before = _snapshot(model, opt)
    pending = ckpt.async_save_checkpoint(root, 4, model, opt)
    same_sync = _outcome(lambda: ckpt.save_checkpoint(root, 4, model, opt))
    same_async = _outcome(lambda: ckpt.async_save_checkpoint(root, 4, model, opt))
    other_async = _outcome(lambda: ckpt.async_save_checkpoint(root, 5, model, opt))
    pending.wait()
    fresh, fresh_opt = _trained(seed=5)
    ckpt.load_checkpoint(root, fresh, fresh_opt)
    return (
        same_sync,
        same_async,
        other_async,
        ckpt.complete_steps(root),
        _same(_snapshot(fresh, fresh_opt), before),
    )


def _three_groups(model: nn.Module, muon_first: int, lr: float = 0.02) -> list[dict[str, Any]]:
    """Muon's hidden matrices in two groups, the first holding ``layers.0 .. layers.{muon_first-1}``,
    the second at learning rate ``lr``."""
    muon, adamw = split_params(model)
    first = [(n, p) for n, p in muon["params"] if int(n.split(".")[1]) < muon_first]
    rest = [(n, p) for n, p in muon["params"] if int(n.split(".")[1]) >= muon_first]
    return [{"params": first}, {"params": rest, "lr": lr}, adamw]


def load_other_groups(root: str, how: str) -> tuple[str, str, bool, bool]:
    """Save with one grouping, load into an optimizer grouped otherwise ("split": the Muon matrices
    cut at another layer; "split_lr": the same, the saved second group at another learning rate;
    "reordered": AdamW's group first). (outcome, message, nothing changed, every parameter, state
    entry and setting is the saved one)."""
    if how == "reordered":
        model, opt = _trained()
        other = lambda m: split_params(m)[::-1]  # noqa: E731
    else:
        model, opt = _trained(groups=lambda m: _three_groups(m, 3, 0.01 if how == "split_lr" else 0.02))
        other = lambda m: _three_groups(m, 2)  # noqa: E731
    ckpt.save_checkpoint(root, 1, model, opt)
    fresh, fresh_opt = _trained(seed=5, groups=other)
    before = _snapshot(fresh, fresh_opt)
    kind, message = _outcome(lambda: ckpt.load_checkpoint(root, fresh, fresh_opt))
    after, saved = _snapshot(fresh, fresh_opt), _snapshot(model, opt)
    del after["groups"], saved["groups"]  # by index; compared by FQN below
    same_as_saved = _same(after, saved) and _settings(fresh, fresh_opt) == _settings(model, opt)
    return kind, message, _same(_snapshot(fresh, fresh_opt), before), same_as_saved


def _settings(model: nn.Module, opt: Muon) -> dict[str, Any]:
    """Each parameter's group settings, by FQN."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for g in opt.param_groups
        for p in g["params"]
    }


class _Unpicklable(Exception):
    def __init__(self, message: str, callback: Callable[[], None]) -> None:
        super().__init__(message)
        self.callback = callback


def first_errors() -> list[tuple[str, str, bool] | None]:
    """Rank 0 fails with an OSError; then rank 1 with an exception holding a lambda; then nobody.
    Each: (type, message, whether this rank got its own exception object back)."""
    rank = dist.get_rank()
    cases: list[BaseException | None] = [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "x") if rank == 0 else None,
        _Unpicklable("no pickle", lambda: None) if rank == 1 else None,
        None,
    ]
    out: list[tuple[str, str, bool] | None] = []
    for mine in cases:
        try:
            raise_together(mine, None, "test")
            out.append(None)
        except Exception as first:  # noqa: BLE001 - what every rank raised
            out.append((type(first).__name__, str(first), first is mine))
    return out
