"""The model ``plan --check`` checks: a preset or a Hugging Face ``config.json`` read as data, its fields
checked against ``planning.inputs``' limits before anything is built, and its parameters on the meta
device with Hugging Face's names (``meta_model``): Llama's attention, or DeepSeek-V3's multi-head
latent attention (MLA) where the config has ``kv_lora_rank``; a gated MLP, or routed experts as
stacks ``[E, out, in]`` (torchtitan's grouped experts: gate, up, down) with a router and
``n_shared_experts`` shared ones, after the first ``first_k_dense_replace`` dense layers."""

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
# deepseek-ai/DeepSeek-V3's config.json (planning.shapes.DEEPSEEK_V3 cites it); Kimi K2 is DeepSeek-V3's
# code with 64 heads, 384 experts, one dense layer and its own vocabulary (moonshotai/Kimi-K2-Instruct).
_DEEPSEEK = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
}  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3-70b": _LLAMA | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "llama3.1-405b": _LLAMA | {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128},
    "deepseek-v3": _DEEPSEEK,
    "kimi-k2": _DEEPSEEK | {"vocab_size": 163840, "num_attention_heads": 64, "num_key_value_heads": 64,
                            "n_routed_experts": 384, "first_k_dense_replace": 1},
}  # fmt: skip
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
# A config.json is a few KiB; a file this large is not one (and would be read whole).
MAX_CONFIG_BYTES = 16 << 20
# Muon matrices a check lays out: about 20 x Kimi K2's 47,000 (61 layers of 384 experts, 2 stacks
# each). Every one is planned on every rank, so a model beyond this would run for hours.
MAX_MATRICES = 1 << 20
# DeepSeek's multi-head latent attention: low ranks of q and of k, v, and the per-head widths
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_LIMITS = {
    "num_hidden_layers": (MAX_LAYERS, "more layers than any model has"),
    **{k: (MAX_WIDTH, "wider than any model's matrices") for k in ("vocab_size", "hidden_size", "head_dim")},
    **{
        k: (MAX_WIDTH, "wider than any model's matrices")
        for k in ("intermediate_size", "moe_intermediate_size")
    },
    **{k: (MAX_WIDTH, "more heads than rows") for k in ("num_attention_heads", "num_key_value_heads")},
    **{k: (MAX_EXPERTS, "more experts than any model has") for k in (*EXPERT_KEYS, "n_shared_experts")},
    **{k: (MAX_WIDTH, "wider than any model's matrices") for k in _MLA},
    "first_k_dense_replace": (MAX_LAYERS, "more layers than any model has"),
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
    if not _field(config, "moe_intermediate_size") or _dense_layers(config):
        _need(config, "intermediate_size")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if _field(config, "kv_lora_rank"):
        _mla_rows(config)
        return
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


def _mla_rows(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """MLA's widths: q's rows (heads x (nope + rope)), kv_b's (heads x (nope + v)) and o's columns
    (heads x v); ValueError naming the fields where one is missing or above ``MAX_WIDTH``."""
    heads, nope, rope, v = (_need(config, k) for k in ("num_attention_heads", *_MLA[2:]))
    widths = {"qk_nope_head_dim + qk_rope_head_dim": nope + rope, "qk_nope_head_dim + v_head_dim": nope + v}
    widths["v_head_dim"] = v
    for fields, width in widths.items():
        if heads * width > MAX_WIDTH:
            raise ValueError(
                f"config fields 'num_attention_heads' x ({fields}) = {heads * width:,} rows, above the limit "
                f"of {MAX_WIDTH:,}: wider than any model's matrices"
            )
    return heads * (nope + rope), heads * (nope + v), heads * v


def _experts(config: Mapping[str, Any]) -> int:
    return next((config[k] for k in EXPERT_KEYS if config.get(k)), 0)


def _dense_layers(config: Mapping[str, Any]) -> int:
    """Layers with a dense MLP: every one without experts, else the first ``first_k_dense_replace``."""
    layers = config["num_hidden_layers"]
    return min(config.get("first_k_dense_replace") or 0, layers) if _experts(config) else layers


def muon_matrices(config: Mapping[str, Any], head_dim: int | None) -> int:
    """How many Muon matrices ``meta_model(config)`` has (q, k, v cut per head with ``head_dim``);
    ValueError above ``MAX_MATRICES``."""
    heads = config["num_attention_heads"]
    if config.get("kv_lora_rank"):  # MLA: q_a and q_b (or q), kv_a, kv_b, o
        attention = 5 if config.get("q_lora_rank") else 4
    else:
        rows = config.get("head_dim") or config["hidden_size"] // heads
        kv = config.get("num_key_value_heads") or heads
        attention = ((heads * rows + 2 * kv * rows) // head_dim if head_dim else 3) + 1
    layers, dense, experts = config["num_hidden_layers"], _dense_layers(config), _experts(config)
    moe = 1 + (3 if config.get("n_shared_experts") else 0) + 3 * experts  # router, shared, stacks
    count = layers * attention + dense * 3 + (layers - dense) * moe
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


def _linear(cols: int, rows: int) -> nn.Linear:
    return nn.Linear(cols, rows, bias=False, device=META)


def _gated(hidden: int, ffn: int) -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "gate_proj": _linear(hidden, ffn),
            "up_proj": _linear(hidden, ffn),
            "down_proj": _linear(ffn, hidden),
        }
    )


def _attention(config: Mapping[str, Any]) -> nn.ModuleDict:
    """Llama's q, k, v, o; or MLA's (``_mla``) where the config has ``kv_lora_rank``."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("kv_lora_rank"):
        return _mla(config)
    head_dim = config.get("head_dim") or hidden // heads
    kv = (config.get("num_key_value_heads") or heads) * head_dim
    return nn.ModuleDict(
        {"q_proj": _linear(hidden, heads * head_dim), "k_proj": _linear(hidden, kv),
         "v_proj": _linear(hidden, kv), "o_proj": _linear(heads * head_dim, hidden)}
    )  # fmt: skip


def _mla(config: Mapping[str, Any]) -> nn.ModuleDict:
    """Multi-head latent attention as DeepSeek-V3's ``modeling_deepseek.py`` names it: q_a and q_b
    (q alone without ``q_lora_rank``), kv_a with the shared rope key, kv_b, o, and the two low-rank
    norms (``planning.shapes.mla_shapes``, in its order)."""
    hidden, q_rank, kv_rank = config["hidden_size"], config.get("q_lora_rank"), config["kv_lora_rank"]
    q_rows, kv_rows, o_cols = _mla_rows(config)
    out: dict[str, nn.Module] = {"q_proj": _linear(hidden, q_rows)}
    if q_rank:
        out = {"q_a_proj": _linear(hidden, q_rank), "q_a_layernorm": nn.RMSNorm(q_rank, device=META)}
        out["q_b_proj"] = _linear(q_rank, q_rows)
    out["kv_a_proj_with_mqa"] = _linear(hidden, kv_rank + config["qk_rope_head_dim"])
    out["kv_a_layernorm"] = nn.RMSNorm(kv_rank, device=META)
    out["kv_b_proj"] = _linear(kv_rank, kv_rows)
    out["o_proj"] = _linear(o_cols, hidden)
    return nn.ModuleDict(out)


class _Experts(nn.Module):
    """Routed experts as stacks ``[E, out, in]`` (torchtitan's grouped experts: gate, up, down), their
    router (``gate``, as Hugging Face DeepSeek names it) and the shared experts' gated MLP."""

    def __init__(self, config: Mapping[str, Any], experts: int) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        ffn = config.get("moe_intermediate_size") or _need(config, "intermediate_size")
        self.gate_experts = nn.Parameter(torch.empty(experts, ffn, hidden, device=META))
        self.up_experts = nn.Parameter(torch.empty(experts, ffn, hidden, device=META))
        self.down_experts = nn.Parameter(torch.empty(experts, hidden, ffn, device=META))
        self.gate = _linear(hidden, experts)
        if config.get("n_shared_experts"):
            self.shared_experts = _gated(hidden, ffn * config["n_shared_experts"])


class _Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any], index: int) -> None:
        super().__init__()
        hidden = _need(config, "hidden_size")
        self.self_attn = _attention(config)
        experts = _experts(config)
        dense = index < _dense_layers(config)
        self.mlp = _gated(hidden, _need(config, "intermediate_size")) if dense else _Experts(config, experts)
        self.input_layernorm = nn.RMSNorm(hidden, device=META)
        self.post_attention_layernorm = nn.RMSNorm(hidden, device=META)


def meta_model(config: Mapping[str, Any]) -> nn.Module:
    """A decoder with the config's parameter names and shapes (Hugging Face Llama's or DeepSeek's), on meta;
    ValueError naming the field where the config is out of range (``validate_config``)."""
    validate_config(config)
    model = nn.Module()
    shape = (config["vocab_size"], config["hidden_size"])  # _weight: meta's normal_ would import dynamo
    model.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape, device=META))
    model.layers = nn.ModuleList(_Layer(config, i) for i in range(config["num_hidden_layers"]))
    model.norm = nn.RMSNorm(config["hidden_size"], device=META)
    if not config.get("tie_word_embeddings", False):
        model.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=META)
    return model
