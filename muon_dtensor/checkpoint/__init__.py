"""Sharded checkpoints: thin clients of ``torch.distributed.checkpoint`` (saving in ``helpers``,
loading in ``loading``, what a load must fit in ``fit`` and ``layout``, fresh state in ``_fresh``),
checksummed manifests (``manifest``) published atomically (``publish``), a folder read as data
(``safe_read``), Hugging Face safetensors in and out (``safetensors``), each rank's own tensors in
``extra`` (``extra_tensors``), the arguments every rank agrees on (``agree``) over object gathers
(``collectives``), and the shared dtypes, errors and warnings (``_dtypes``, ``_errors``,
``_warnings``). Row ``checkpoint/`` of docs/design.md's layer table."""

from __future__ import annotations

from .helpers import PendingSave, async_save_checkpoint, latest_step, load_checkpoint, save_checkpoint
from .manifest import CheckpointError, complete_steps, step_dir
from .safetensors import export_safetensors, load_safetensors

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
