"""Split a model's parameters the usual way: hidden 2-D matrices to Muon, the rest to AdamW.

Muon is meant for hidden-layer matrices (Keller Jordan, "Muon: An optimizer for hidden layers in
neural networks"); embeddings, the output head, norms and biases stay with AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatch
from typing import Any

from torch import nn

__all__ = ["DEFAULT_HEAD_NAMES", "split_params"]

# Last component of the module path of common output heads (GPT-2/Llama "lm_head", torchtitan
# "output", timm/torchvision "head", "fc", "classifier").
DEFAULT_HEAD_NAMES = ("lm_head", "output", "head", "classifier")
# Module path components added by torch.compile and activation checkpointing (DCP drops them too):
# heads and patterns are matched without them, so a wrapped model splits as the plain one does.
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def _embedding_params(model: nn.Module) -> set[int]:
    return {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag)
        for p in module.parameters(recurse=False)
    }


def split_params(
    model: nn.Module,
    *,
    muon: Sequence[str] = (),
    adamw: Sequence[str] = (),
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    adamw_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for ``muon_dtensor.Muon``: ``[{muon group}, {"algorithm": "adamw", ...}]``.

    Args:
        model: the model (before or after ``fully_shard``; names are the same).
        muon: glob patterns of parameter names forced into the Muon group.
        adamw: glob patterns of parameter names forced into the AdamW group (wins over ``muon``).
        head_names: module names treated as output heads.
        adamw_options: extra keys for the AdamW group (``lr``, ``betas``, ``eps``, ``weight_decay``).
    Parameters keep their names, so errors and checkpoints use FQNs. Frozen parameters are left out.
    """
    embeddings = _embedding_params(model)
    groups: dict[str, list] = {"muon": [], "adamw": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = ".".join(part for part in name.split(".") if part not in _WRAPPERS)
        module_name = plain.rsplit(".", 1)[0] if "." in plain else ""
        is_head = module_name.rsplit(".", 1)[-1] in head_names
        hidden = p.ndim == 2 and id(p) not in embeddings and not is_head
        if _matches(plain, adamw):
            hidden = False
        elif _matches(plain, muon):
            hidden = True
        groups["muon" if hidden else "adamw"].append((name, p))
    out: list[dict[str, Any]] = []
    if groups["muon"]:
        out.append({"params": groups["muon"], "algorithm": "muon"})
    if groups["adamw"]:
        out.append({"params": groups["adamw"], "algorithm": "adamw", **(adamw_options or {})})
    return out
