"""Sharded checkpoints: thin clients of ``torch.distributed.checkpoint`` (saving in ``save``,
loading in ``loading``, what a load must fit in ``fit``, the key formats in ``keys``, fresh state
in ``_fresh``), checksummed manifests (``manifest``) published atomically (``publish``), a folder
read as data (``safe_read``), Hugging Face safetensors in and out (``safetensors``), each rank's own
tensors in ``extra`` (``extra_tensors``), the arguments every rank agrees on (``arguments_agree``)
and the ranks holding each saved entry (``holders``) over object gathers (``collectives``), and the shared dtypes, errors and warnings (``_dtypes``,
``_errors``, ``_warnings``). Row ``checkpoint/`` of docs/design.md's layer table."""

from __future__ import annotations

from .loading import latest_step, load_checkpoint
from .manifest import CheckpointError, complete_steps, step_dir
from .safetensors import export_safetensors, load_safetensors
from .save import PendingSave, async_save_checkpoint, save_checkpoint

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
