"""What a parameter's name says: the names errors use (FQNs, or positions), and which module names
are output heads, q/k/v projections, or matrices whose rows are not heads. Pure string rules shared by
``split_params``, the checks and ``Muon.describe``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatch
from typing import Any

__all__ = [
    "DEFAULT_HEAD_NAMES",
    "DEFAULT_QKV_NAMES",
    "NOT_HEAD_NAMES",
    "matches",
    "module_of",
    "not_heads",
    "param_names",
    "refusal",
    "strip_wrappers",
]

# Last component of the module path of common output heads (GPT-2/Llama "lm_head", torchtitan
# "output", timm/torchvision "head", "fc", "classifier").
DEFAULT_HEAD_NAMES = ("lm_head", "output", "head", "classifier")
# Last component of the module path of q, k, v projections whose rows are heads: Hugging Face
# Llama/Mistral/Qwen ("q_proj", fused "qkv_proj"), torchtitan ("wq"), BERT ("query"), GPT-NeoX.
DEFAULT_QKV_NAMES = (
    "q_proj", "k_proj", "v_proj", "qkv_proj", "wq", "wk", "wv", "query", "key", "value", "query_key_value",
)  # fmt: skip
# Output projections and MLP matrices: rows that are not heads, so head_dim must never reach them.
NOT_HEAD_NAMES = frozenset((
    "o", "o_proj", "out_proj", "wo", "c_proj", "dense", "proj", "attn_out", "gate", "up", "down",
    "gate_proj", "up_proj", "down_proj", "fc", "fc1", "fc2", "c_fc", "w1", "w2", "w3", "dense_h_to_4h",
    "dense_4h_to_h", "mlp",
))  # fmt: skip
# Module path components added by torch.compile and activation checkpointing (DCP drops them too):
# heads and patterns are matched without them, so a wrapped model splits as the plain one does.
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def strip_wrappers(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def module_of(name: str) -> str:
    """Last component of the module path of a parameter FQN ("" at the root)."""
    plain = strip_wrappers(name)
    return plain.rsplit(".", 2)[-2] if plain.count(".") else ""


def not_heads(names: Sequence[str]) -> list[str]:
    """The parameter FQNs among ``names`` whose module is an output projection or an MLP matrix:
    rows that are not attention heads (positional names match nothing)."""
    return [n for n in names if module_of(n) in NOT_HEAD_NAMES]


def refusal(name: str, shape: tuple[int, ...], head_names: Sequence[str] = DEFAULT_HEAD_NAMES) -> str:
    """Why a parameter is not Muon's, by ``split_params``' rules (for ``Muon.describe``)."""
    module = module_of(name)
    if len(shape) < 2:
        return f"{len(shape)}-D (a norm, bias or scalar): Muon orthogonalizes matrices only"
    if len(shape) > 2:
        return f"{len(shape)}-D: a Muon group with 'flatten' (conv) or 'experts' (stacks) would take it"
    if module in head_names:
        return f"output head (module '{module}' is in head_names): AdamW by Muon's recipe"
    if any(key in strip_wrappers(name).lower() for key in ("embed", "wte", "wpe")):
        return "embedding: AdamW by Muon's recipe"
    return "2-D, put in AdamW by the caller (an adamw= pattern, or a group built by hand)"


def param_names(group: Mapping[str, Any], index: int) -> list[str]:
    """The names errors use: a group's ``param_names`` (FQNs from named parameters), or positions."""
    if "param_names" in group:
        return list(group["param_names"])
    return [f"param_groups[{index}]['params'][{i}]" for i in range(len(group["params"]))]
