"""The optimizer state's plumbing, outside the ``Muon`` shell: eager state, state that follows a
parameter swapped for its DTensor, and counters brought back to the host after a load."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._sharding.param_layout import local_grad, local_of, relayout, row_state_zeros
from .functional import adamw_step

__all__ = ["SECOND_MOMENT", "adamw_group_step", "follow_replaced", "init_state", "settle_loaded"]

SECOND_MOMENT = "second_momentum_buffer"  # NorMuon's state key, the official implementation's name
State = MutableMapping[Tensor, dict[str, Any]]


def init_state(state: State, group: Mapping[str, Any], p: Tensor) -> None:
    """Create ``p``'s missing state eagerly, so every rank has the same keys even before the first
    step and a checkpoint at step 0 (or of a parameter that never got a gradient) is complete."""
    muon = group["algorithm"] == "muon"
    mine = state[p]
    if not muon and "step" not in mine:
        mine["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in ("momentum_buffer",) if muon else ("exp_avg", "exp_avg_sq"):
        if key not in mine:
            mine[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if muon and group.get("normuon", False) and SECOND_MOMENT not in mine:
        mine[SECOND_MOMENT] = row_state_zeros(p)  # one value per row, laid out with p


def follow_replaced(state: State, groups: Sequence[Mapping[str, Any]], seen: dict[int, list[Tensor]]) -> None:
    """Parameters replaced in place in ``groups`` (accelerate and HF Trainer swap in the DTensors
    ``fully_shard`` made) take over their predecessors' state, laid out like them; ``seen`` holds
    each group's parameters as last seen and is brought up to date."""
    for index, group in enumerate(groups):
        for old, new in zip(seen.get(index, []), group["params"]):
            if old is not new and old in state and new not in state:
                state[new] = {k: relayout(v, old, new) for k, v in state.pop(old).items()}
        seen[index] = list(group["params"])


def settle_loaded(state: State, groups: Iterable[Mapping[str, Any]]) -> None:
    """After torch's ``load_state_dict``: state the checkpoint lacked created again, and AdamW's
    counters (saved on a device, perhaps) back on the host as float32."""
    for group in groups:
        for p in group["params"]:
            init_state(state, group, p)
            if "step" in state[p]:
                state[p]["step"] = state[p]["step"].detach().to("cpu", torch.float32)


def adamw_group_step(state: State, group: Mapping[str, Any], params: Sequence[Tensor]) -> None:
    """An AdamW group's step over ``params`` (those with a gradient), on their local shards."""
    states = [state[p] for p in params]
    adamw_step(
        [local_of(p) for p in params],
        [local_grad(p) for p in params],
        [local_of(s["exp_avg"]) for s in states],
        [local_of(s["exp_avg_sq"]) for s in states],
        [s["step"] for s in states],
        **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")},
    )
