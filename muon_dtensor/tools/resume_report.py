"""Judging a resume check (in the caller's process): each compared tensor against its profile's
bound, and the first place the runs differ named as the cause (docs/resume.md, "Profiles")."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["BF16_ULP", "BOUNDS", "FLOAT32_ULP", "GRADIENT_ENVELOPE", "ULPS_PER_STEP", "compare"]

FLOAT32_ULP = 2.0**-23  # ulp(x) <= 2**-23 * |x| for a normal float32 x
BF16_ULP = 2.0**-8  # bf16 keeps 8 significant bits: relative rounding <= 2**-8
ULPS_PER_STEP = 4  # first_step_float: a few float32 roundings of the parameter per resumed step
# same_gradients: a gradient summed in another order from the same parameters and data differs by at
# most gamma_n * sum|terms| (Higham, Accuracy and Stability, 4.2); with bf16 roundings (u = 2**-8)
# and up to 16 partial sums, 16 * 2**-8 of the gradient's scale. Another batch differs at O(1).
GRADIENT_ENVELOPE = 16 * BF16_ULP
Tensors = dict[str, torch.Tensor]


def _max_diff(a: Tensors, b: Tensors) -> tuple[float, str]:
    """The largest |a - b| over every tensor, and its name (inf for a missing or reshaped one)."""
    worst, where = 0.0, ""
    for name in sorted(a.keys() | b.keys()):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape:
            return math.inf, name
        d = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        if d > worst or not where:
            worst, where = d, name
    return worst, where


def _tolerance(profile: str, ref: torch.Tensor, n: int, lr_sum: float, state: bool) -> float:
    """How far a tensor ``n`` steps after the resume may be from the uninterrupted run's: a few
    float32 roundings of its scale per step, or a bf16 rounding of each step's update (entries at
    most ``lr``; optimizer state, which is no update, gets a bf16 rounding of its own scale)."""
    if profile in ("bitwise", "same_gradients") or n == 0:
        return 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    if profile == "first_step_float":
        return ULPS_PER_STEP * FLOAT32_ULP * scale * n
    return BF16_ULP * (scale * n if state else lr_sum)


# Each profile's bound, as the report states it (docs/resume.md, "Profiles").
BOUNDS = {
    "bitwise": "0: equal",
    "same_gradients": "0: equal (the gradients' own bound is under 'gradients')",
    "first_step_float": f"{ULPS_PER_STEP} * 2**-23 * max|x| * n (n: steps since the resume)",
    "bf16_envelope": "parameters: 2**-8 * sum of the largest group lr over the resumed steps (update entries "
    "at most lr; a clipped or rescaled update can exceed it); optimizer state: 2**-8 * max|x| * n",
}


def _judge(
    a: Tensors, b: Tensors, profile: str, n: int, lr_sum: float, state: bool = False
) -> tuple[bool, float, str, float]:
    """(every tensor within the profile, largest diff, its name, that tensor's bound)."""
    ok = a.keys() == b.keys()
    for name, x in a.items():
        y = b.get(name)
        if y is None or y.shape != x.shape:
            return False, math.inf, name, 0.0
        d = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        ok = ok and d <= _tolerance(profile, x, n, lr_sum, state)
    d, name = _max_diff(a, b)
    bound = _tolerance(profile, a[name], n, lr_sum, state) if name in a else 0.0
    return ok, d, name, bound


def _per_step(
    straight: dict[str, Any], resumed: dict[str, Any], profile: str
) -> tuple[dict[str, Any], float]:
    """Each step's parameter verdict from the save on, and the summed learning rate since the save."""
    save_at, lr_sum, per_step = min(straight["params"]), 0.0, {}
    for step in sorted(straight["params"]):
        lr_sum += straight["lrs"].get(step, 0.0) if step > save_at else 0.0
        mine = resumed["params"].get(step, {})
        ok, d, name, bound = _judge(straight["params"][step], mine, profile, step - save_at, lr_sum)
        per_step[str(step)] = {"max_diff": d, "tensor": name, "bound": bound, "within": ok}
    return per_step, lr_sum


def compare(
    straight: dict[str, Any], resumed: dict[str, Any], *, profile: str, world_sizes: tuple[int, int]
) -> dict[str, Any]:
    """The report: per-step parameter differences, state differences, verdict and cause."""
    save_at, last = min(straight["params"]), max(straight["params"])
    per_step, lr_sum = _per_step(straight, resumed, profile)
    first_diff = next((int(s) for s, v in per_step.items() if v["max_diff"] > 0), None)
    first_fail = next((int(s) for s, v in per_step.items() if not v["within"]), None)
    state = _judge(straight["state"], resumed["state"], profile, last - save_at, lr_sum, state=True)
    first_grads = (g.get(save_at + 1, {}) for g in (straight["grads"], resumed["grads"]))
    grad_d, grad_name = _max_diff(*first_grads)
    out: dict[str, Any] = {
        "profile": profile,
        "bound": BOUNDS[profile],
        "world_sizes": list(world_sizes),
        "per_step": per_step,
        "first_difference_step": first_diff,
        "first_failure_step": first_fail,
        "optimizer_state": {"max_diff": state[1], "tensor": state[2], "bound": state[3], "within": state[0]},
        "first_resumed_grads": {"step": save_at + 1, "max_diff": grad_d, "tensor": grad_name},
        "scheduler_equal": straight["scheduler"] == resumed["scheduler"],
        "rng_equal": straight["rng"] == resumed["rng"],
    }
    same = out["scheduler_equal"] and out["rng_equal"]
    out["bitwise"] = first_diff is None and state[1] == 0 and same
    out["passed"] = first_fail is None and state[0] and same
    if profile == "same_gradients":
        out["gradients"] = _gradients(straight["grads"], resumed["grads"])
        out["passed"] = out["passed"] and out["gradients"]["within"]
    out["cause"] = None if out["bitwise"] else _cause(out, save_at)
    return out


def _cause(out: dict[str, Any], save_at: int) -> str:
    """Why the resumed run differs, from the first place it does."""
    before, after = out["world_sizes"]
    changed = (
        f"world size changed ({before} -> {after})" if before != after else f"same world size ({before})"
    )
    grads, per_step = out["first_resumed_grads"], out["per_step"]
    if per_step[str(save_at)]["max_diff"] > 0:
        return "the loaded parameters differ from the saved ones: the checkpoint did not restore the model"
    if grads["max_diff"] > 0 and before != after:
        return (
            f"{changed} and gradients are not micro-batch invariant: the gradient sum order differs. The "
            f"first resumed step's gradients differ (max |diff| {grads['max_diff']:.3g} in {grads['tensor']}) "
            "before the optimizer runs. The micro-batch recipe (micro_batches_for, loss_scale, one micro-batch per "
            "rank at the larger world size) makes them equal"
        )
    if grads["max_diff"] > 0:
        return (
            f"{changed}, yet the first resumed step's gradients differ (max |diff| {grads['max_diff']:.3g} in "
            f"{grads['tensor']}): the data position, RNG or model state after loading is not the uninterrupted run's"
        )
    if per_step.get(str(save_at + 1), {}).get("max_diff", 0) > 0 or out["optimizer_state"]["max_diff"] > 0:
        return (
            f"{changed}; the first resumed step's gradients agree but the optimizer's result differs: its state "
            "was not restored exactly, or its arithmetic depends on the world size (an option such as ns_split)"
        )
    if not out["rng_equal"]:
        return (
            "the RNG state at the end differs: the loop draws random numbers the checkpoint did not restore"
        )
    if not out["scheduler_equal"]:
        return "the scheduler state at the end differs: it was not restored or not stepped the same way"
    return f"{changed}; the runs first differ at step {out['first_difference_step']}, after the first resumed step"


def _gradients(straight: dict[int, Tensors], resumed: dict[int, Tensors]) -> dict[str, Any]:
    """same_gradients: the resumed run's own gradients (before the replay) against the ones it stepped
    on, relative to each tensor's scale; within GRADIENT_ENVELOPE unless the data, RNG or model differ."""
    worst: dict[str, Any] = {"max_rel_diff": 0.0, "step": None, "tensor": ""}
    for step in sorted(straight):
        for name, ref in straight[step].items():
            mine = resumed.get(step, {}).get(name)
            if mine is None or mine.shape != ref.shape:
                return {"max_rel_diff": math.inf, "step": step, "tensor": name, "within": False}
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            d = float((mine.double() - ref.double()).abs().max()) if ref.numel() else 0.0
            rel = d / scale if scale else (math.inf if d else 0.0)
            if rel > worst["max_rel_diff"]:
                worst = {"max_rel_diff": rel, "step": step, "tensor": name}
    return {**worst, "within": worst["max_rel_diff"] <= GRADIENT_ENVELOPE}
