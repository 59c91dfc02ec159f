"""Does a loop resume exactly? A twin comparison a user runs on their own model and loop.

``run_resume_check(build, train_step, steps=..., save_at=...)`` runs, each in fresh processes: the
uninterrupted run to ``steps``; a run to ``save_at`` that saves a checkpoint (model, optimizer,
scheduler, RNG) and exits; a resumed run on the resume world size that loads it and continues. It
compares parameters after every step from ``save_at`` on, the optimizer state, the scheduler state
and the RNG state at the end, under a named tolerance profile, and names a cause when the runs differ
(docs/resume.md).

``micro_batches_for`` and ``loss_scale`` are the micro-batch recipe that makes a loop's gradients the
same bits on any power-of-two world size, so a resume on another world size can be bitwise.
"""

from __future__ import annotations

import base64
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from ..checkpoint import load_checkpoint, save_checkpoint
from ..testing.rank import FunctionRef, resolve
from ..testing.runner import check_launch, function_ref, run_ranks
from .resume_report import compare

__all__ = ["PROFILES", "loss_scale", "micro_batches_for", "run_resume_check"]

PROFILES = ("bitwise", "same_gradients", "first_step_float", "bf16_envelope")

Build = Callable[[int, int], tuple[nn.Module, Optimizer, Any]]
TrainStep = Callable[[nn.Module, Optimizer, Any, int, int, int], Any]
Tensors = dict[str, torch.Tensor]


def micro_batches_for(rank: int, world: int, n_micro: int) -> range:
    """The indices of the step's ``n_micro`` micro-batches that ``rank`` of ``world`` trains on."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank should be in [0, world) but rank is {rank} and world {world}")
    if n_micro < 1 or n_micro % world:
        raise ValueError(
            f"n_micro should be a positive multiple of the world size {world} but is {n_micro}: "
            "pick a count every world size you use divides (a power of two keeps the scaling exact)"
        )
    share = n_micro // world
    return range(rank * share, (rank + 1) * share)


def loss_scale(world: int, n_micro: int) -> float:
    """Multiply each micro-batch's (mean) loss by this before ``backward``: FSDP2 divides by
    ``world`` before it sums over ranks, so the gradient is the mean over the ``n_micro`` micro-batches."""
    micro_batches_for(0, world, n_micro)
    return world / n_micro


def run_resume_check(
    build: Build | str,
    train_step: TrainStep | str,
    *,
    steps: int,
    save_at: int,
    world_sizes: tuple[int, int] = (2, 2),
    profile: str = "bitwise",
    report: str | Path | None = None,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Save at ``save_at`` on ``world_sizes[0]`` ranks, resume on ``world_sizes[1]``, compare with the
    uninterrupted run to ``steps``; returns the report (also written as JSON to ``report``).

    ``build(rank, world)`` returns ``(model, optimizer, scheduler or None)`` with the same seed every
    call; ``train_step(model, optimizer, scheduler, step, rank, world)`` runs step ``step`` (from 1)
    and must call ``optimizer.step()`` once. Each is a module-level function (of a module, or of the
    calling script, whose call must then sit under ``if __name__ == "__main__":``) or a
    ``"module:function"`` string; the ranks find them where the caller does (``testing.function_ref``).
    Bad arguments raise ValueError / TypeError before any rank starts."""
    _check_inputs(steps, save_at, world_sizes, profile, report, timeout)
    loop = (
        function_ref(build, "build", "run_resume_check"),
        function_ref(train_step, "train_step", "run_resume_check"),
    )
    save_world, resume_world = world_sizes
    with tempfile.TemporaryDirectory(prefix="resume_check_") as tmp:
        straight = run_ranks(_rank_run, save_world, *loop, None, None, save_at, steps, None, timeout=timeout)
        run_ranks(_rank_run, save_world, *loop, None, tmp, save_at, save_at, None, timeout=timeout)
        replay = None
        if profile == "same_gradients":  # the resumed run steps on the uninterrupted run's gradients
            replay = str(Path(tmp) / "gradients.pt")
            torch.save(straight[0]["grads"], replay)
        resumed = run_ranks(
            _rank_run, resume_world, *loop, tmp, None, save_at, steps, replay, timeout=timeout
        )
    out = compare(straight[0], resumed[0], profile=profile, world_sizes=world_sizes)
    out.update(steps=steps, save_at=save_at)
    if report is not None:
        Path(report).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return out


def _check_inputs(
    steps: int, save_at: int, world_sizes: Any, profile: str, report: str | Path | None, timeout: Any
) -> None:
    """Refuse bad arguments here, before any rank starts."""
    if profile not in PROFILES:
        raise ValueError(f"profile should be one of {', '.join(PROFILES)} but is {profile!r}")
    if not (isinstance(save_at, int) and isinstance(steps, int) and 1 <= save_at < steps):
        raise ValueError(
            f"save_at and steps should be ints with 1 <= save_at < steps but are {save_at}, {steps}"
        )
    sizes = tuple(world_sizes) if isinstance(world_sizes, tuple | list) else ()
    if len(sizes) != 2 or not all(isinstance(w, int) and w >= 1 for w in sizes):
        raise ValueError(f"world_sizes should be two positive ints (save, resume) but is {world_sizes!r}")
    for which, world in zip(("save", "resume"), sizes):
        check_launch(world, timeout, f"world_sizes' {which} world size")
    if report is not None:
        path = Path(report)
        if path.is_dir():
            raise ValueError(
                f"report should be a file path but {str(report)!r} is a folder: pass a file in it, e.g. "
                f"{str(path / 'resume_report.json')!r}"
            )
        if not path.parent.is_dir():
            raise ValueError(
                f"report should be a file path in an existing folder but the folder of {str(report)!r} "
                f"({str(path.parent)!r}) does not exist: create it first, or pass another path"
            )


# --- on every rank ------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    """A tensor's full value (collective for a DTensor), detached, on the CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _params(model: nn.Module) -> Tensors:
    return {name: _full(p) for name, p in model.named_parameters()}


def _state(model: nn.Module, opt: Optimizer) -> Tensors:
    """The optimizer state as full tensors by parameter name and key (rank 0 holds them)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim: dict[str, Any] = dict(get_state_dict(model, opt, options=options)[1])
    return {
        f"{name}/{key}": torch.as_tensor(value).detach().clone()
        for name, entry in optim.get("state", {}).items()
        for key, value in entry.items()
    }


def _rng() -> list[str]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())
    return [base64.b64encode(s.numpy().tobytes()).decode() for s in states]


def _set_rng(states: list[str]) -> None:
    tensors = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in states]
    torch.set_rng_state(tensors[0])
    if torch.cuda.is_available() and len(tensors) > 1:
        torch.cuda.set_rng_state(tensors[1])


def _save(folder: str, step: int, model: nn.Module, opt: Optimizer, sched: Any) -> None:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _rng())
    extra = {"scheduler": sched.state_dict() if sched is not None else None, "rng": everyone}
    save_checkpoint(folder, step, model, opt, extra=extra)


def _load(folder: str, model: nn.Module, opt: Optimizer, sched: Any) -> int:
    """Load the checkpoint; rank r continues saved rank r's RNG (rank 0's where the saving run had
    fewer ranks: on another world size a per-rank stream has no exact continuation)."""
    info = load_checkpoint(folder, model, opt)
    if info is None:
        raise RuntimeError(f"resume check: no checkpoint under {folder}")
    if sched is not None:
        sched.load_state_dict(info["scheduler"])
    saved = info["rng"]
    _set_rng(saved[dist.get_rank()] if dist.get_rank() < len(saved) else saved[0])
    return int(info["step"])


class _Grads:
    """Full gradients and the largest learning rate just before ``optimizer.step()`` of each step
    from ``at`` on; with ``replay`` (step -> gradients), the step then runs on those instead."""

    def __init__(self, model: nn.Module, opt: Optimizer, at: int, replay: dict[int, Tensors] | None) -> None:
        self.model, self.at, self.step, self.replay = model, at, 0, replay
        self.grads: dict[int, Tensors] = {}
        self.lrs: dict[int, float] = {}
        opt.register_step_pre_hook(self._hook)

    def _hook(self, opt: Optimizer, args: Any, kwargs: Any) -> None:
        self.lrs.setdefault(self.step, max(float(g["lr"]) for g in opt.param_groups))
        if self.step < self.at or self.step in self.grads:
            return
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        self.grads[self.step] = {n: _full(p.grad) for n, p in named}  # type: ignore[arg-type]
        if self.replay is not None:
            for n, p in named:
                g = self.replay[self.step][n].to(p.grad.dtype)  # type: ignore[union-attr]
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g


def _rank_run(
    build_ref: FunctionRef,
    step_ref: FunctionRef,
    load_from: str | None,
    save_to: str | None,
    save_at: int,
    last: int,
    replay: str | None,
) -> dict[str, Any] | None:
    """Train to ``last`` (from a checkpoint when ``load_from``); save at ``last`` when ``save_to``;
    step on the gradients saved at ``replay`` when given. Rank 0 returns parameters from ``save_at``
    on, the gradients of each resumed step, final states."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train_step = resolve(step_ref)
    model, opt, sched = resolve(build_ref)(rank, world)
    first = _load(load_from, model, opt, sched) + 1 if load_from else 1
    replayed = torch.load(replay, weights_only=True) if replay else None  # this check's own file
    grads = _Grads(model, opt, save_at + 1, replayed)
    params = {save_at: _params(model)} if load_from else {}
    for step in range(first, last + 1):
        grads.step = step
        train_step(model, opt, sched, step, rank, world)
        if step >= save_at:
            params[step] = _params(model)
    if save_to:
        _save(save_to, last, model, opt, sched)
        return None
    state = _state(model, opt)
    scheduler = sched.state_dict() if sched is not None else None
    out = {"params": params, "grads": grads.grads, "lrs": grads.lrs, "state": state, "scheduler": scheduler}
    return {**out, "rng": _rng()} if rank == 0 else None
