"""A Hugging Face Llama trained with FSDP2 and one muon_dtensor optimizer, saved on 2 ranks and
resumed on 1, then exported to safetensors that transformers loads offline.

The model is a LlamaForCausalLM from a small config (no download), FSDP2 per decoder layer. Skipped
where transformers is not installed (the "hf" extra installs it).

Every step's batch is the same ``MICRO`` micro-batches on any world size; each rank takes its share
and scales each micro-batch's loss by ``world / MICRO`` (a power of two, so exact). FSDP2 divides by
the world size before it sums over ranks, so the gradient is the same sum of the same micro-batch
gradients at 2 ranks and at 1, and the 2 -> 1 resume must end bitwise where the uninterrupted run
ends. (With one batch split over ranks instead, 1 and 2 ranks sum gradients in different orders and
the runs drift apart by rounding that no bound from one host's bf16 can fix.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import muon_dtensor.checkpoint as ckpt  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.checkpoint.safetensors import export_safetensors, load_safetensors  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402
from tests.helpers.models import full  # noqa: E402

TOTAL, SPLIT = 6, 3
MICRO, MICRO_SIZE, SEQ = 2, 4, 16  # the batch: MICRO micro-batches of MICRO_SIZE sequences


@pytest.mark.slow
def test_llama_saved_on_2_resumed_on_1_ends_where_uninterrupted_ends(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    straight, first = run_ranks(uninterrupted_and_save_part, 2, root, TOTAL, SPLIT, timeout=240)[0]
    resumed = run_ranks(resume, 1, root, TOTAL, timeout=240)[0]
    assert straight["losses"][-1] < straight["losses"][0]
    assert first["losses"] == straight["losses"][:SPLIT]  # same layout, same data: bitwise
    # Same micro-batch gradients summed in the same order on 1 rank as on 2: bitwise here too.
    assert resumed["losses"] == straight["losses"][SPLIT:]
    for name, p in straight["params"].items():
        assert torch.equal(resumed["params"][name], p), name

    # safetensors out: transformers loads it offline and sees the checkpoint's weights.
    out = tmp_path / "hf"
    export_safetensors(tmp_path / "ckpt" / f"step_{SPLIT:08d}", out, max_shard_bytes=40_000, config=config())
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    loaded = dict(LlamaForCausalLM.from_pretrained(out).named_parameters())
    for name, p in first["params"].items():
        assert torch.equal(loaded[name].detach(), p), name
    # safetensors in: a 2-rank sharded model reads only its blocks and ends up with the same weights.
    back = run_ranks(from_safetensors, 2, str(out), timeout=240)[0]
    for name, p in first["params"].items():
        assert torch.equal(back[name], p), name


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def build(seed: int = 0) -> nn.Module:
    """A Llama from ``seed``, fully_shard per decoder layer over every rank."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config())
    model.config._attn_implementation = "eager"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(model: nn.Module) -> Muon:
    return Muon(split_params(model, adamw_options={"lr": 3e-3}), lr=0.02)


def train(model: nn.Module, opt: Muon, steps: range) -> list[float]:
    """Real steps on counting sequences; each rank takes its share of the micro-batches (module
    docstring); the mean micro-batch loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = MICRO // world
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        start = torch.randint(0, 64, (MICRO * MICRO_SIZE, 1), generator=gen)
        ids = (start + torch.arange(SEQ) * torch.randint(1, 4, (MICRO * MICRO_SIZE, 1), generator=gen)) % 64
        opt.zero_grad()
        total = torch.zeros(())
        for micro in ids.split(MICRO_SIZE)[rank * share : (rank + 1) * share]:
            loss = model(input_ids=micro, labels=micro).loss
            (loss * (world / MICRO)).backward()
            total += loss.detach()
        opt.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total / MICRO))
    return losses


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def uninterrupted_and_save_part(root: str, total: int, split: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The uninterrupted run to ``total``, then a second run to ``split`` that saves a checkpoint."""
    model = build()
    opt = optimizer(model)
    straight = {"losses": train(model, opt, range(total)), "params": _weights(model)}
    model = build()
    opt = optimizer(model)
    losses = train(model, opt, range(split))
    ckpt.save_checkpoint(root, split, model, opt)
    return straight, {"losses": losses, "params": _weights(model)}


def resume(root: str, total: int) -> dict[str, Any]:
    model = build(seed=5)
    opt = optimizer(model)
    info = ckpt.load_checkpoint(root, model, opt)
    assert info is not None
    return {"losses": train(model, opt, range(info["step"], total)), "params": _weights(model)}


def from_safetensors(folder: str) -> dict[str, torch.Tensor]:
    model = build(seed=9)
    load_safetensors(model, folder)
    return _weights(model)


def test_export_writes_the_config_or_says_it_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``from_pretrained`` reads ``config.json``: export writes it from ``config=`` (a Hugging Face
    config or a dict), and warns when neither it nor a file already there gives one."""
    from muon_dtensor.checkpoint.safetensors import _write_config

    _write_config(tmp_path, {"model_type": "llama", "hidden_size": 32})
    assert '"hidden_size": 32' in (tmp_path / "config.json").read_text()
    (tmp_path / "hf").mkdir()
    _write_config(tmp_path / "hf", config())
    assert LlamaConfig.from_pretrained(tmp_path / "hf").hidden_size == 32
    with caplog.at_level("WARNING"):
        (tmp_path / "bare").mkdir()
        _write_config(tmp_path / "bare", None)
    assert "no config.json" in caplog.text and "config=model.config" in caplog.text
