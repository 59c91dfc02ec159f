"""``muon_dtensor.Muon`` as a torchtitan optimizer (torchtitan 0.3.0).

torchtitan builds its optimizers from ``Trainer.Config.optimizer``, an ``OptimizersContainer.Config``:
each ``ParamGroupConfig`` names an optimizer, and ``OptimizersContainer._resolve_optimizer_factory``
turns that name into a class ("Adam", "AdamW", "DistMuon"). ``MuonOptimizersContainer`` adds
"Muon"; its ``Config`` builds it, so a trainer config selects Muon with one assignment::

    config.optimizer = muon_optimizer_config(lr=0.02, adamw_lr=8e-4)

Everything else is torchtitan's own: one optimizer per model part and optimizer name, groups that
carry ``param_names``, ``fused`` and ``foreach``, ``LambdaLR`` schedulers that add ``initial_lr``,
and the checkpointer's ``dcp.save({"optimizer": container, ...})`` of the container's flat,
FQN-keyed state dict. ``muon_dtensor.Muon`` keeps every momentum buffer as a DTensor laid out like
its parameter, so each rank writes its own shards. See ``README.md`` here and ``docs/torchtitan.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # type: ignore[import-untyped]

from muon_dtensor import Muon

__all__ = ["LLAMA_MATRICES", "MuonOptimizersContainer", "muon_optimizer_config"]

# The hidden matrices of torchtitan's Llama 3 (q, k, v, o and the three MLP projections; 0.3.0's
# models fuse q, k, v into attention.qkv_linear.wqkv, one Muon matrix). Embeddings, norms and the
# output head match the catch-all group and get AdamW, as in the Muon papers.
LLAMA_MATRICES = r"^layers\.\d+\.(attention\.(w[qkvo]|qkv_linear\.wqkv)|feed_forward\.w[123])\.weight$"


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``optimizer_name="Muon"``."""

    # torchtitan's Configurable wires Config.build() to the class that declares Config, so a
    # subclass must declare its own (even empty) for build() to construct it.
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name == "Muon":
            return Muon
        return OptimizersContainer._resolve_optimizer_factory(name)


def muon_optimizer_config(
    *,
    lr: float = 0.02,
    weight_decay: float = 0.1,
    adamw_lr: float = 8e-4,
    adamw_weight_decay: float = 0.1,
    muon_pattern: str = LLAMA_MATRICES,
    muon_kwargs: dict[str, Any] | None = None,
) -> MuonOptimizersContainer.Config:
    """Muon for the parameters whose FQN matches ``muon_pattern`` (2-D matrices; see
    ``muon_dtensor.Muon`` for conv or expert weights), AdamW for every other parameter, in one
    ``muon_dtensor.Muon`` per model part (``"algorithm": "adamw"`` groups). ``muon_kwargs`` adds
    Muon arguments (``momentum``, ``adjust_lr_fn``, ``ns_coefficients``, ...) to the Muon group.

    torchtitan's default ``implementation="fused"`` puts ``fused=True`` in every group; Muon has
    one implementation and ignores ``fused`` and ``foreach`` (docs/torchtitan.md)."""
    muon = {"lr": lr, "weight_decay": weight_decay, **(muon_kwargs or {})}
    adamw = {
        "algorithm": "adamw",
        "lr": adamw_lr,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": adamw_weight_decay,
    }
    return MuonOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=muon_pattern, optimizer_name="Muon", optimizer_kwargs=muon),
            ParamGroupConfig(pattern=r".*", optimizer_name="Muon", optimizer_kwargs=adamw),
        ]
    )
