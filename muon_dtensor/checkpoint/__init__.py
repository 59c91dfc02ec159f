"""Sharded checkpoints: thin clients of ``torch.distributed.checkpoint`` (``helpers``), checksummed
manifests (``manifest``) and Hugging Face safetensors in and out (``safetensors``)."""

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
