"""(d) CUDA-graph capture of a steady muon_dtensor.Muon step, with the learning rate changing.

Per variant, two copies of part (c)'s model and optimizer step in lockstep on the same gradients
(copied into the same ``.grad`` tensors each step, the graph's static inputs): one eagerly, one
by replaying a graph captured after ``warmup`` steps (warmed up on a side stream, as torch's CUDA
graph docs ask). The learning rate changes every step after the capture, by the variant's route:
a float in ``group["lr"]``, a CPU tensor or a CUDA tensor filled in place; a constant float is the
baseline. Recorded: does capture work (else the exception text), is each replayed step's state
bitwise the eager one's, and host and device time of a replay against an eager step; beside each,
the outcome expected before the run (``VARIANTS``), what was observed, and whether they agree.
The one variant expected to fail its capture runs last, on its own capture stream. On CPU the
harness runs with an eager step in place of the replay (no graphs there) and the part is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.gpucheck.common import Settings, Skipped, error_text
from benchmarks.gpucheck.step import LR, copy_model, make_model, make_optimizer, seed_grads, time_steps

# name -> (how lr is held, whether it changes every step after the capture, the outcome expected
# before the run: what torch's capture semantics imply, not a finding). "capturable": a float64 CUDA
# tensor lr with Muon(capturable=True), whose replays should follow it (docs/design.md). A graph
# replays the lr it captured when the lr is a Python float or a CPU tensor (read on the host at
# capture). A plain CUDA tensor lr fails the capture (its value is read on the host); it runs last,
# on a capture stream of its own, so a failed capture cannot touch the other variants.
VARIANTS = {
    "constant float lr": ("float", False, "replay == eager"),
    "float group['lr'], changed every step": ("float", True, "replay != eager"),
    "CPU tensor lr, filled every step": ("cpu", True, "replay != eager"),
    "capturable=True, CUDA float64 lr, filled every step": ("capturable", True, "replay == eager"),
    "CUDA tensor lr, filled every step": ("cuda", True, "capture fails"),
}


def observed(row: dict[str, Any]) -> str:
    """The variant's outcome in the words of ``VARIANTS``' expectations."""
    if not row.get("capture", True):
        return "capture fails"
    return "replay == eager" if all(row["replay_equals_eager_per_step"]) else "replay != eager"


class Run:
    """A model, its muon_dtensor.Muon, and the lr tensor it was built with (None: a float)."""

    def __init__(self, base: nn.Module, holder: str) -> None:
        self.model = copy_model(base)
        device = next(base.parameters()).device
        where = {"cpu": torch.device("cpu"), "cuda": device, "capturable": device}.get(holder)
        dtype = torch.float64 if holder == "capturable" else torch.float32
        self.lr = None if where is None else torch.tensor(LR, dtype=dtype, device=where)
        lr = LR if self.lr is None else self.lr
        self.opt = make_optimizer("muon_dtensor.Muon", self.model, lr, capturable=holder == "capturable")

    def set_lr(self, value: float) -> None:
        if self.lr is not None:
            self.lr.fill_(value)
        else:
            for group in self.opt.param_groups:
                group["lr"] = value

    def state(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        return params + [t for p in params for t in self.opt.state[p].values() if torch.is_tensor(t)]


def lr_at(k: int) -> float:
    """The learning rate of lockstep step k: never the capture's."""
    return LR * (1.0 - 0.05 * (k + 1))


def new_grads(runs: list[Run], seed: int) -> None:
    """The same fresh random gradient into every run's existing ``.grad`` tensors."""
    params = list(runs[0].model.parameters())
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    fresh = [torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) for p in params]
    for run in runs:
        for p, g in zip(run.model.parameters(), fresh):
            p.grad.copy_(g)  # type: ignore[union-attr]


def warm_up(graphed: Run, eager: Run, steps: int, cuda: bool) -> None:
    """``steps`` steps of both runs; the graphed one's on a side stream on CUDA."""
    for _ in range(steps):
        eager.opt.step()
    if not cuda:
        for _ in range(steps):
            graphed.opt.step()
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(steps):
            graphed.opt.step()
    torch.cuda.current_stream().wait_stream(side)


def lockstep(graphed: Run, eager: Run, replay: Any, changing: bool, steps: int) -> dict[str, Any]:
    """``steps`` steps of both runs on the same gradients and lr; per step, bitwise equal?"""
    equal = []
    for k in range(steps):
        value = lr_at(k) if changing else LR
        graphed.set_lr(value)
        eager.set_lr(value)
        new_grads([graphed, eager], 100 + k)
        replay()
        eager.opt.step()
        equal.append(all(torch.equal(a, b) for a, b in zip(graphed.state(), eager.state())))
    diff = max(
        (a - b).abs().max().item() for a, b in zip(graphed.model.parameters(), eager.model.parameters())
    )
    return {"replay_equals_eager_per_step": equal, "max_abs_param_diff": diff}


def variant(name: str, base: nn.Module, settings: Settings) -> dict[str, Any]:
    holder, changing, expected = VARIANTS[name]
    if holder in ("cuda", "capturable") and not settings.cuda:
        return {"skipped": "needs CUDA", "expected": expected}
    seed_grads(base, 1)
    graphed, eager = Run(base, holder), Run(base, holder)
    warm_up(graphed, eager, settings.warmup, settings.cuda)
    row: dict[str, Any] = {"lr_changes": changing, "expected": expected}
    replay: Callable[[], Any] = graphed.opt.step
    if settings.cuda:
        graph = torch.cuda.CUDAGraph()
        try:  # a fresh capture stream: torch.cuda.graph's default one is shared by every capture
            with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                graphed.opt.step()
        except Exception as exc:  # noqa: BLE001 - a failed capture is this variant's result
            row |= {"capture": False, "capture_error": error_text(exc)}
            return row | {"observed": observed(row), "as_expected": observed(row) == expected}
        row["capture"], replay = True, graph.replay
    row |= lockstep(graphed, eager, replay, changing, settings.lockstep)
    row |= {"observed": observed(row), "as_expected": observed(row) == expected}
    row["replay"] = time_steps(replay, settings.step_reps, settings.device)
    row["eager"] = time_steps(eager.opt.step, settings.step_reps, settings.device)
    return row


def part_d(settings: Settings) -> dict[str, Any]:
    base = make_model(settings.layers, settings.dims, settings.device)
    if not settings.cuda:
        harness = variant("float group['lr'], changed every step", base, settings)
        raise Skipped("CUDA graphs need a CUDA device; the lockstep harness ran with eager steps", harness)
    rows: dict[str, Any] = {}
    for name in VARIANTS:
        if settings.left_s() < 20:
            rows[name] = {"skipped": "--budget-s spent"}
            continue
        try:
            rows[name] = variant(name, base, settings)
        except Exception as exc:  # noqa: BLE001 - one variant's failure is recorded
            rows[name] = {"error": error_text(exc)}
        torch.cuda.empty_cache()
    return {"variants": rows}
