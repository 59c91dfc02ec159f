"""A Hugging Face Llama (tiny config, no download) split into 2 pipeline stages through
``muon_dtensor.integrations.pipeline`` (``hf_decoder``, ``keep_prefixes``, torch's ``PipelineStage``
and ``ScheduleGPipe``), saved after step 2 by both stages, then resumed merged on 1 rank with
``merged_step``: step 3's weights equal the stages' step 3, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint
from muon_dtensor.integrations.pipeline import (
    even_prefixes,
    hf_decoder,
    keep_prefixes,
    merged_step,
    pipeline_step,
    stage_schedule,
)
from tests.harness.ranks import run_ranks

pytest.importorskip("transformers")
pytestmark = pytest.mark.integration
SAVE_AT, STEPS, MICRO, LAYERS = 2, 3, 2, 4


def llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=72, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return hf_decoder(model)


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(100 + step))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_two_hf_stages_resume_merged_on_one_rank_bitwise(tmp_path: Path) -> None:
    stages = run_ranks(train_stages, 2, str(tmp_path), timeout=180)
    (merged,) = run_ranks(resume_merged, 1, str(tmp_path), timeout=180)
    expected = stages[0] | stages[1]
    assert sorted(expected) == sorted(merged), sorted(expected.keys() ^ merged.keys())
    assert [k for k in expected if not torch.equal(expected[k], merged[k])] == []
    assert not any(k in stages[1] for k in stages[0])  # each stage held its own part
    assert "model.layers.3.self_attn.q_proj.weight" in stages[1]  # global FQNs kept


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def train_stages(folder: str) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    prefixes = even_prefixes(
        LAYERS,
        2,
        first=["model.embed_tokens"],
        last=["model.norm", "lm_head"],
        blocks="model.layers",
        every=["model.rotary_emb"],
    )
    part = keep_prefixes(llama(0), prefixes[rank])
    opt = Muon(split_params(part), lr=0.02)
    schedule = stage_schedule(
        part, rank, 2, device=torch.device("cpu"), group=None, n_microbatches=MICRO, loss_fn=loss_fn
    )
    for step in range(1, STEPS + 1):
        batch = rows(step)
        pipeline_step(
            schedule, opt, batch[:, :-1] if rank == 0 else None, batch[:, 1:] if rank == 1 else None
        )
        if step == SAVE_AT:
            save_checkpoint(folder, step, part, opt)
    return {k: v.detach().clone() for k, v in part.named_parameters()}


def resume_merged(folder: str) -> dict[str, Any]:
    model = llama(1)  # other initial weights: the load must bring the saved ones
    opt = Muon(split_params(model), lr=0.02)
    assert load_checkpoint(folder, model, opt) == {"step": SAVE_AT}
    for step in range(SAVE_AT + 1, STEPS + 1):
        merged_step(model, opt, [(m[:, :-1], m[:, 1:]) for m in rows(step).chunk(MICRO)], loss_fn)
    return {k: v.detach().clone() for k, v in model.named_parameters()}
