"""Switching optimizers mid-run, and checkpoints that do not depend on module wrappers.

- ``optimizer_state="fresh"``: ``load_checkpoint`` loads the weights alone and restarts the optimizer
  (zero momentum, step 0). It must be asked for: a checkpoint without this optimizer's state (one
  written with AdamW, a weights-only one) is refused by default, so a resume never drops momentum
  silently.
- ``param_names``: torch's ``Optimizer.load_state_dict`` replaces an optimizer's parameter names with
  the checkpoint's. DCP already drops wrapper components (``_orig_mod.`` of ``torch.compile``,
  ``_checkpoint_wrapped_module.`` of activation checkpointing) from state keys and group ``params``,
  but not from these names: a save stores the unwrapped FQNs as names, a load keeps this optimizer's.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from ..optim.optimizer import Muon
from ..optim.state import init_state

__all__ = [
    "FRESH_HINT",
    "OPTIMIZER_STATES",
    "check_optimizer_state",
    "keep_param_names",
    "start_fresh",
]

OPTIMIZER_STATES = ("load", "fresh")
FRESH_HINT = (
    "To load the model weights alone and start this optimizer fresh (zero momentum, step 0), as when "
    "switching from another optimizer, pass optimizer_state='fresh' to load_checkpoint."
)


def check_optimizer_state(optimizer_state: Any, optimizer: Optimizer | None) -> bool:
    """Whether the load starts the optimizer fresh; ValueError for a value that means nothing. Local:
    the same on every rank, before any collective."""
    if type(optimizer_state) is not str or optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(
            f"optimizer_state should be 'load' (load the checkpoint's optimizer state, refuse a "
            f"checkpoint without it) or 'fresh' (weights only, optimizer restarted) but is {optimizer_state!r}"
        )
    if optimizer_state == "fresh" and optimizer is None:
        raise ValueError(
            "optimizer_state='fresh' restarts the optimizer passed to load_checkpoint, but none was "
            "passed; pass the optimizer, or leave optimizer_state at 'load' for a weights-only load"
        )
    return optimizer_state == "fresh"


def start_fresh(optimizer: Optimizer) -> None:
    """Drop every state entry, as if the optimizer had just been built: Muon creates its state again
    at once, as its ``__init__`` does (zero momentum, AdamW step 0); torch's optimizers create theirs
    at their first step. The param groups stay the same objects, hyperparameters included."""
    optimizer.state.clear()
    if isinstance(optimizer, Muon):
        for group in optimizer.param_groups:
            for p in group["params"]:
                init_state(optimizer.state, group, p)


def keep_param_names(optim_sd: dict[str, Any], optimizer: Optimizer) -> None:
    """In a loaded state dict: each group's names become this optimizer's, whatever the saving run's
    wrappers were, so errors keep naming this model's parameters."""
    for group, loaded in zip(optimizer.param_groups, optim_sd.get("param_groups", [])):
        if "param_names" in group and "param_names" in loaded:
            loaded["param_names"] = list(group["param_names"])
