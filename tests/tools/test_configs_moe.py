"""``plan --check`` and ``plan --rehearse`` take the MoE presets (issue 48 item 4): the meta model of
DeepSeek-V3 and Kimi K2 has MLA's matrices, the shared experts and the first dense layers, with the
shapes and counts the cost model prices (``planning.experts.MOE_MODELS``). Before, the reader knew
Llama's attention only, so the launch modes priced a different model from the plain ``plan``'s. Pure:
meta tensors, no process."""

from __future__ import annotations

from dataclasses import replace

import pytest

from muon_dtensor.planning.experts import MOE_MODELS
from muon_dtensor.tools.configs import PRESETS, meta_model, muon_matrices, validate_config
from muon_dtensor.tools.launch_check import moe_model

SMALL_MLA = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8,
}  # fmt: skip


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_the_meta_model_has_the_cost_models_matrices(name: str) -> None:
    config = PRESETS[name]
    got = moe_model(meta_model(config))
    assert got is not None and replace(got, name=name) == MOE_MODELS[name]  # shapes, in order, and counts
    assert muon_matrices(config, None) == len(got.dense) + got.expert_matrices


def test_mla_without_q_lora_rank_has_one_q_projection() -> None:
    """DeepSeek-V2-Lite's form: no ``q_lora_rank``, so q is one matrix of heads x (nope + rope) rows."""
    names = {n: tuple(p.shape) for n, p in meta_model(SMALL_MLA).named_parameters()}
    attn = {n.split(".")[-2]: s for n, s in names.items() if n.startswith("layers.0.self_attn.")}
    assert attn == {
        "q_proj": (4 * 12, 64), "kv_a_proj_with_mqa": (16 + 4, 64), "kv_a_layernorm": (16,),
        "kv_b_proj": (4 * 16, 16), "o_proj": (64, 4 * 8),
    }  # fmt: skip
    assert muon_matrices(SMALL_MLA, None) == 2 * (4 + 3)


def test_an_mla_field_out_of_range_is_named() -> None:
    with pytest.raises(ValueError, match=r"'qk_rope_head_dim' must be a positive integer but is None"):
        validate_config({k: v for k, v in SMALL_MLA.items() if k != "qk_rope_head_dim"})
    with pytest.raises(ValueError, match=r"'num_attention_heads' x \(qk_nope_head_dim \+ qk_rope_head_dim\)"):
        validate_config(SMALL_MLA | {"num_attention_heads": 1 << 17})  # 12 x 2**17 rows of q
