"""Hugging Face ``transformers.Trainer``: Muon as an optimizer factory, and FSDP2 on CPU ranks.

The Trainer builds a plain optimizer class from its own weight-decay groups, which hold the 1-D
norms and biases Muon refuses; a *factory* (``optimizer_cls_and_kwargs=(factory, kwargs)``, any
callable that is not an ``Optimizer`` class) is instead called as ``factory()(model, **kwargs)``
and builds its own groups. Nothing here imports transformers or accelerate at import time.
Guide: docs/hf_trainer.md.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..optim.optimizer import Muon
from ..optim.param_groups import split_params

__all__ = ["FsdpOnCpu", "LogMuonMetrics", "MuonForTrainer"]

_SPLIT_KEYS = frozenset(inspect.signature(split_params).parameters) - {"model"}


class MuonForTrainer:
    """``Trainer(..., optimizer_cls_and_kwargs=(MuonForTrainer, {"lr": 0.02, ...}))``.

    The Trainer calls ``MuonForTrainer()(model, **kwargs)`` with the plain model (under FSDP2 too:
    accelerate then swaps in the sharded parameters, which ``Muon`` follows). The keys of
    ``split_params`` (``adamw_options``, ``head_dim``, ``qkv``, ``muon``, ``adamw``, ``head_names``)
    go to it; every other key goes to ``Muon``. The Trainer's ``learning_rate`` and
    ``weight_decay`` are not passed to a factory: give ``lr`` and ``weight_decay`` here.
    """

    def __call__(self, model: nn.Module, **kwargs: Any) -> Muon:
        split = {k: v for k, v in kwargs.items() if k in _SPLIT_KEYS}
        options = {k: v for k, v in kwargs.items() if k not in _SPLIT_KEYS}
        return Muon(split_params(model, **split), **options)


class FsdpOnCpu:
    """Mixin for CPU runs: ``class CpuTrainer(FsdpOnCpu, transformers.Trainer)``.

    accelerate (1.15) keeps its FSDP plugin only on accelerators; on CPU ranks (``MULTI_CPU``) it
    drops it without a word and the Trainer trains DDP. This marks the state FSDP with the Trainer's
    own plugin, as accelerate does on a GPU, so ``fully_shard``, the parameter swap and the
    checkpoints are accelerate's FSDP2 code. For trying a configuration on CPU; GPUs need nothing.
    """

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        _keep_fsdp_on_cpu(self)


class LogMuonMetrics:
    """Mixin: ``class MyTrainer(LogMuonMetrics, transformers.Trainer)``. Every training log (the one
    with ``"loss"``) also carries ``Muon.metrics(reduce=True)``, the job's figures, so the Trainer's
    own loggers (TensorBoard, wandb) report them. accelerate wraps the optimizer
    (``trainer.optimizer.optimizer`` is the ``Muon``); this unwraps it. Collective, as the Trainer's
    ``log`` is: it runs on every rank (the Trainer gathers the loss there too)."""

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        opt = getattr(self, "optimizer", None)
        while opt is not None and not isinstance(opt, Muon) and hasattr(opt, "optimizer"):
            opt = opt.optimizer  # accelerate's AcceleratedOptimizer, and any other wrapper
        if isinstance(opt, Muon) and "loss" in logs:
            logs.update(opt.metrics(reduce=True))
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


def _keep_fsdp_on_cpu(trainer: Any) -> None:
    """``FsdpOnCpu``'s step on a Trainer whose accelerator was just made."""
    from accelerate import state as accelerate_state  # type: ignore[import-untyped]
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # type: ignore[import-untyped]

    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU and trainer.args.fsdp_plugin_args:
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        state.distributed_type = DistributedType.FSDP
        accelerate_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
