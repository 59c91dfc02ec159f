"""A Hugging Face Llama trained with FSDP2 and one muon_dtensor optimizer, saved on 2 ranks and
resumed on 1, then exported to safetensors that transformers loads offline."""

from __future__ import annotations

import torch

from muon_dtensor.checkpoint.safetensors import export_safetensors
from tests.distributed import run_ranks
from tests.workers_hf import config, from_safetensors, resume, save_part, uninterrupted

TOTAL, SPLIT = 6, 3


def test_llama_saved_on_2_resumed_on_1_ends_where_uninterrupted_ends(tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    straight = run_ranks(uninterrupted, 2, TOTAL, timeout=240)[0]
    first = run_ranks(save_part, 2, root, SPLIT, timeout=240)[0]
    resumed = run_ranks(resume, 1, root, TOTAL, timeout=240)[0]
    assert straight["losses"][-1] < straight["losses"][0]
    assert first["losses"] == straight["losses"][:SPLIT]  # same layout, same data: bitwise
    # One rank reduces gradients in another order than two: float tolerance from here on.
    torch.testing.assert_close(resumed["losses"], straight["losses"][SPLIT:], rtol=1e-3, atol=1e-3)
    for name, p in straight["params"].items():
        assert (resumed["params"][name] - p).abs().max() <= 2e-3, name

    # safetensors out: transformers loads it offline and sees the checkpoint's weights.
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    export_safetensors(tmp_path / "ckpt" / f"step_{SPLIT:08d}", out, max_shard_bytes=40_000)
    assert (out / "model.safetensors.index.json").is_file()
    config().save_pretrained(out)
    loaded = dict(LlamaForCausalLM.from_pretrained(out).named_parameters())
    for name, p in first["params"].items():
        assert torch.equal(loaded[name].detach(), p), name
    # safetensors in: a 2-rank sharded model reads only its blocks and ends up with the same weights.
    back = run_ranks(from_safetensors, 2, str(out), timeout=240)[0]
    for name, p in first["params"].items():
        assert torch.equal(back[name], p), name
