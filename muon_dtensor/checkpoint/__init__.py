"""Sharded checkpoints: thin clients of ``torch.distributed.checkpoint`` (saving in ``save``,
loading in ``loading``, what a load must fit in ``fit``, the key formats in ``keys``, fresh state
in ``_fresh``), checksummed manifests (``manifest``) published atomically (``publish``), a folder
read as data (``safe_read``), Hugging Face safetensors in and out (``safetensors``), each rank's own
tensors in ``extra`` (``extra_tensors``), the arguments every rank agrees on (``arguments_agree``)
over object gathers (``collectives``), and the shared dtypes, errors and warnings (``_dtypes``,
``_errors``, ``_warnings``). Row ``checkpoint/`` of docs/design.md's layer table."""

from __future__ import annotations

import sys
from types import ModuleType

from . import arguments_agree, keys, save
from .manifest import CheckpointError, complete_steps, step_dir
from .safetensors import export_safetensors, load_safetensors
from .save import PendingSave, async_save_checkpoint, latest_step, load_checkpoint, save_checkpoint

# The module paths before 0.6, for one release (CHANGELOG.md): the same module objects under the old
# names, with no file at the old path (so ``import muon_dtensor.checkpoint.helpers`` still works).
_MOVED = {"helpers": save, "layout": keys, "agree": arguments_agree}
for _old, _new in _MOVED.items():
    sys.modules.setdefault(f"{__name__}.{_old}", _new)


def __getattr__(name: str) -> ModuleType:
    if name in _MOVED:
        return _MOVED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "PendingSave",
    "async_save_checkpoint",
    "complete_steps",
    "export_safetensors",
    "latest_step",
    "load_checkpoint",
    "load_safetensors",
    "save_checkpoint",
    "step_dir",
]
