"""The model ``plan --check`` checks: a preset or a Hugging Face ``config.json`` read as data, its fields
checked against ``planning.inputs``' limits before anything is built, and its parameters on the meta
device with Llama's names (``meta_model``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..planning.inputs import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH

# Modules are built on meta by argument, and the embedding from an empty weight: its normal_ init on
# meta goes through torch._refs, whose first use imports dynamo (about 800 modules, 1.5 s).
META = torch.device("meta")

__all__ = ["PRESETS", "load_config", "meta_model", "muon_matrices", "validate_config"]

# Hugging Face config.json fields of the Llama 3 presets (Meta's params.json, as in planning.shapes).
_LLAMA = {"vocab_size": 128256, "num_key_value_heads": 8, "tie_word_embeddings": False}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3-70b": _LLAMA | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "llama3.1-405b": _LLAMA | {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128},
}  # fmt: skip
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# A config.json is a few KiB; a file this large is not one (and would be read whole).
MAX_CONFIG_BYTES = 16 << 20
# Muon matrices a check lays out: about 20 x Kimi K2's 47,000 (61 layers of 384 experts, 2 stacks
# each). Every one is planned on every rank, so a model beyond this would run for hours.
MAX_MATRICES = 1 << 20
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_LIMITS = {
    "num_hidden_layers": (MAX_LAYERS, "more layers than any model has"),
    **{k: (MAX_WIDTH, "wider than any model's matrices") for k in ("vocab_size", "hidden_size", "head_dim")},
    **{
        k: (MAX_WIDTH, "wider than any model's matrices")
        for k in ("intermediate_size", "moe_intermediate_size")
    },
    **{k: (MAX_WIDTH, "more heads than rows") for k in ("num_attention_heads", "num_key_value_heads")},
    **{k: (MAX_EXPERTS, "more experts than any model has") for k in EXPERT_KEYS},
}


def load_config(source: str) -> dict[str, Any]:
    """A preset's fields, or a ``config.json`` read as data (a multimodal one's ``text_config``);
    ValueError naming the file and what is wrong with it."""
    if source in PRESETS:
        return dict(PRESETS[source])
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{source!r} holds {path.stat().st_size:,} bytes, above the {MAX_CONFIG_BYTES:,} a config.json "
            "may have (a model's is a few KiB): pass the model's config.json"
        )
    try:
        config = json.loads(path.read_bytes())
    except RecursionError:
        raise ValueError(
            f"{source!r} nests JSON deeper than the reader allows: a config.json is a flat object of fields"
        ) from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(
            f"{source!r} is not a readable JSON file ({e}): pass the model's config.json"
        ) from None
    text = config.get("text_config", config) if isinstance(config, dict) else config
    if not isinstance(text, dict):
        where = "its text_config" if text is not config else "it"
        raise ValueError(
            f"{source!r} is not a model config: {where} holds a JSON {type(text).__name__}, not an object "
            'of fields ({"hidden_size": ..., "num_hidden_layers": ...})'
        )
    return dict(text)


def _field(config: Mapping[str, Any], key: str) -> int:
    """A required field, or an optional one (0 when absent, null or 0), within its limit."""
    value = config.get(key)
    if key not in _REQUIRED and value in (None, 0):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config field {key!r} must be a positive integer but is {value!r}")
    limit, why = _LIMITS.get(key, (MAX_WIDTH, "wider than any model's matrices"))
    if value > limit:
        raise ValueError(f"config field {key!r} is {value:,}, above the limit of {limit:,}: {why}")
    return value


def validate_config(config: Mapping[str, Any]) -> None:
    """Every field ``meta_model`` reads is a positive integer within its limit, and the attention
    projections are at most ``MAX_WIDTH`` rows; ValueError naming the field otherwise."""
    for key in _LIMITS:
        _field(config, key)
    if not _field(config, "moe_intermediate_size"):
        _need(config, "intermediate_size")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = _field(config, "head_dim") or hidden // heads
    if not head_dim:
        raise ValueError(
            f"config field 'num_attention_heads' ({heads:,}) is above 'hidden_size' ({hidden:,}) and there is "
            "no 'head_dim': give the config its head_dim"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        rows = (_field(config, key) or heads) * head_dim
        if rows > MAX_WIDTH:
            raise ValueError(
                f"config fields {key!r} x head_dim = {rows:,} rows, above the limit of {MAX_WIDTH:,}: "
                "wider than any model's matrices"
            )


def muon_matrices(config: Mapping[str, Any], head_dim: int | None) -> int:
    """How many Muon matrices ``meta_model(config)`` has (q, k, v cut per head with ``head_dim``);
    ValueError above ``MAX_MATRICES``."""
    heads = config["num_attention_heads"]
    rows = config.get("head_dim") or config["hidden_size"] // heads
    kv = config.get("num_key_value_heads") or heads
    qkv = (heads * rows + 2 * kv * rows) // head_dim if head_dim else 3
    experts = next((config[k] for k in EXPERT_KEYS if config.get(k)), 0)
    count = config["num_hidden_layers"] * (qkv + 1 + (1 + 2 * experts if experts else 3))
    if count > MAX_MATRICES:
        raise ValueError(
            f"the model has {count:,} Muon matrices, above the limit of {MAX_MATRICES:,} (every one is "
            "planned on every rank): check a model with fewer layers or experts"
        )
    return count


def _need(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config field {key!r} must be a positive integer but is {value!r}")
    return value


class _Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, heads = _need(config, "hidden_size"), _need(config, "num_attention_heads")
        head_dim = config.get("head_dim") or hidden // heads
        kv = (config.get("num_key_value_heads") or heads) * head_dim
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(hidden, heads * head_dim, bias=False, device=META),
                "k_proj": nn.Linear(hidden, kv, bias=False, device=META),
                "v_proj": nn.Linear(hidden, kv, bias=False, device=META),
                "o_proj": nn.Linear(heads * head_dim, hidden, bias=False, device=META),
            }
        )
        experts = next((config[k] for k in EXPERT_KEYS if config.get(k)), 0)
        ffn = config.get("moe_intermediate_size") or _need(config, "intermediate_size")
        self.mlp: nn.Module
        if experts:  # a router and stacks of experts ([E, out, in], as torchtitan's grouped experts)
            self.mlp = nn.ParameterDict(
                {
                    "gate_up_experts": nn.Parameter(torch.empty(experts, 2 * ffn, hidden, device=META)),
                    "down_experts": nn.Parameter(torch.empty(experts, hidden, ffn, device=META)),
                }
            )
            self.router = nn.Linear(hidden, experts, bias=False, device=META)
        else:
            self.mlp = nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(hidden, ffn, bias=False, device=META),
                    "up_proj": nn.Linear(hidden, ffn, bias=False, device=META),
                    "down_proj": nn.Linear(ffn, hidden, bias=False, device=META),
                }
            )
        self.input_layernorm = nn.RMSNorm(hidden, device=META)
        self.post_attention_layernorm = nn.RMSNorm(hidden, device=META)


def meta_model(config: Mapping[str, Any]) -> nn.Module:
    """A decoder with the config's parameter names and shapes (Hugging Face Llama's), on meta;
    ValueError naming the field where the config is out of range (``validate_config``)."""
    validate_config(config)
    model = nn.Module()
    shape = (config["vocab_size"], config["hidden_size"])  # _weight: meta's normal_ would import dynamo
    model.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, device=META))
    model.layers = nn.ModuleList(_Layer(config) for _ in range(config["num_hidden_layers"]))
    model.norm = nn.RMSNorm(config["hidden_size"], device=META)
    if not config.get("tie_word_embeddings", False):
        model.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=META)
    return model
