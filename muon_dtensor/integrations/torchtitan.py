"""torchtitan's ``CheckpointManager`` and the checkpoint helpers, both ways (docs/torchtitan.md).

The manager is read through its ``states`` only (``"model"``: torchtitan's ``ModelWrapper``, whose
``model`` is the list of model parts; ``"optimizer"``: the ``OptimizersContainer``, one optimizer per
part; ``"lr_scheduler"``, ``"train_state"``: objects with ``state_dict`` / ``load_state_dict``), so
this module never imports torchtitan.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..checkpoint import load_checkpoint, save_checkpoint

__all__ = ["RESTORED", "load_into_torchtitan", "save_from_torchtitan", "torchtitan_extra"]

# The manager's entries a load restores from plain data (JSON in our folders, torchtitan's own entries in
# its folders). Not the dataloader: torchtitan pickles its state, and unpickling runs code.
RESTORED = ("lr_scheduler", "train_state")


def _parts(manager: Any) -> tuple[list[Any], list[Any]]:
    """The manager's model parts and their optimizers, paired in order."""
    states = getattr(manager, "states", None)
    if not isinstance(states, dict) or "model" not in states or "optimizer" not in states:
        raise TypeError(
            f"manager should be torchtitan's CheckpointManager (enable=True: its states hold 'model' and "
            f"'optimizer') but is {type(manager).__name__}"
        )
    return list(states["model"].model), list(states["optimizer"].optimizers)


def torchtitan_extra(manager: Any) -> dict[str, Any]:
    """The manager's schedulers and train state as ``save_checkpoint``'s ``extra``: each present entry of
    ``RESTORED`` as its ``state_dict()`` (torchtitan's are ints: ``last_epoch``, ``step``, ...)."""
    return {k: manager.states[k].state_dict() for k in RESTORED if manager.states.get(k) is not None}


def save_from_torchtitan(
    root: str | os.PathLike,
    step: int,
    manager: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Path:
    """``save_checkpoint`` of the manager's model parts and optimizers, with ``torchtitan_extra(manager)``
    (and ``extra``) in the manifest; collective, as ``save_checkpoint``."""
    models, optimizers = _parts(manager)
    both = torchtitan_extra(manager) | (extra or {})
    return save_checkpoint(
        root, step, models, optimizers, extra=both, keep_last=keep_last, process_group=process_group
    )


def load_into_torchtitan(
    root: str | os.PathLike,
    manager: Any,
    *,
    step: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any] | None:
    """Load ``step`` of ``root`` (a ``save_checkpoint`` root, or torchtitan's checkpoint folder) into the
    manager's model parts and optimizers through ``load_checkpoint`` (checksums checked, nothing in the
    folder executed, any world size), then restore each ``RESTORED`` entry the checkpoint holds into the
    manager's object of that name. Returns ``load_checkpoint``'s dict (None: no checkpoint, nothing
    changed); collective, as ``load_checkpoint``."""
    models, optimizers = _parts(manager)
    info = load_checkpoint(root, models, optimizers, step=step, process_group=process_group)
    if info is not None:
        for key in RESTORED:
            if key in info and manager.states.get(key) is not None:
                manager.states[key].load_state_dict(info[key])
    return info
