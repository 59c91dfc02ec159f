"""The warning where Muon gets the wrong matrix (issue 51): built by hand, ``Muon(model.parameters())``
or a hand-made group orthogonalized embeddings and output heads with no word. Muon now names every
embedding, weight tied to one, and output head in a Muon group, once, on rank 0, with the fix; the
warning changes no step (bitwise) and ``WrongMatrixWarning`` silences it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import muon_dtensor
from muon_dtensor import Muon, split_params
from muon_dtensor.checks.wrong_matrix import VOCAB_ROWS, WrongMatrixScan, WrongMatrixWarning
from tests.harness.ranks import run_ranks


class TinyLM(nn.Module):
    """An embedding, two hidden matrices and a head (``tied``: the head's weight is the embedding's)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        self.lm_head = nn.Linear(8, 16, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight


def _caught(build: object) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build()  # type: ignore[operator]
    return [str(w.message) for w in seen if issubclass(w.category, WrongMatrixWarning)]


def test_hf_llama_parameters_warns_once_naming_embed_tokens_and_lm_head() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="2D parameters"):  # the norms; the error names split_params
            Muon(model.parameters())  # the warning comes first, with both problems' fix
    messages = [str(w.message) for w in seen if issubclass(w.category, WrongMatrixWarning)]
    assert len(messages) == 1, messages
    assert "model.embed_tokens.weight (an nn.Embedding weight)" in messages[0]
    assert "lm_head.weight (the output head)" in messages[0]
    assert "split_params" in messages[0] and "WrongMatrixWarning" in messages[0]
    # the 2-D matrices as a list of (name, tensor) pairs (no model): by name
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    (message,) = _caught(lambda: Muon(matrices))
    assert "model.embed_tokens.weight (an embedding (by its name))" in message
    assert "lm_head.weight (the output head (by its name))" in message
    assert "layers" not in message  # the hidden matrices are Muon's
    assert _caught(lambda: Muon([p for _, p in matrices])) == []  # bare tensors, a small vocabulary
    assert _caught(lambda: Muon(split_params(model))) == []


def test_tied_named_hand_made_and_silenced() -> None:
    model = TinyLM(tied=True)
    (message,) = _caught(lambda: Muon(model.parameters()))
    assert "embed.weight = lm_head.weight (an nn.Embedding weight, tied to the output head)" in message
    model = TinyLM()
    (message,) = _caught(lambda: Muon(model.named_parameters()))  # a model known: by module type
    assert "embed.weight (an nn.Embedding weight), lm_head.weight (the output head)" in message
    hidden: list[Any] = [model.blocks[0].weight, model.blocks[1].weight]
    groups: list[dict[str, Any]] = [
        {"params": hidden},
        {"params": [model.embed.weight, model.lm_head.weight], "algorithm": "adamw"},
    ]
    assert _caught(lambda: Muon(groups)) == []  # the right split: nothing to say
    opt = Muon([(n, p) for n, p in model.named_parameters() if n.startswith("blocks")])
    head = {"params": [("lm_head.weight", model.lm_head.weight)]}
    (later,) = _caught(lambda: opt.add_param_group(head))  # after the constructor: at once, by name
    assert "lm_head.weight (the output head (by its name))" in later
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=muon_dtensor.WrongMatrixWarning)  # the documented way
        Muon(TinyLM().parameters())
    assert not [w for w in seen if issubclass(w.category, WrongMatrixWarning)]


def test_by_name_and_by_shape_without_a_model() -> None:
    scan = WrongMatrixScan(None)
    names = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "output.weight"]
    scan.add({"params": [torch.zeros(4, 4)] * 3, "param_names": names}, names)  # torchtitan's names
    assert scan.found == [
        "tok_embeddings.weight (an embedding (by its name))",
        "output.weight (the output head (by its name))",
    ]
    scan = WrongMatrixScan(None)
    # the scan reads shapes only: meta tensors (a real VOCAB_ROWS x VOCAB_ROWS // 3 is 1.4 GB to zero)
    vocab, hidden, mlp = (
        torch.empty(VOCAB_ROWS, 8, device="meta"),
        torch.empty(16, 8, device="meta"),
        torch.empty(VOCAB_ROWS, VOCAB_ROWS // 3, device="meta"),
    )
    positions = ["p[0]", "p[1]", "p[2]"]
    scan.add({"params": [vocab, hidden, mlp]}, positions)  # tensors in no module: by shape
    assert scan.found == [
        f"p[0] (an embedding or output head (by its shape: {VOCAB_ROWS} vocabulary rows x 8))"
    ]


def _steps(model: nn.Module, silence: bool) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        if silence:
            warnings.simplefilter("ignore", WrongMatrixWarning)
        opt = Muon(model.parameters(), lr=0.02)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_warning_changes_no_step() -> None:
    torch.manual_seed(0)
    warned, silent = TinyLM(), TinyLM()
    silent.load_state_dict(warned.state_dict())
    for a, b in zip(_steps(warned, False), _steps(silent, True)):
        assert torch.equal(a, b)


def _two_ranks(_: int) -> int:
    seen = _caught(lambda: Muon(TinyLM().parameters()))
    return len(seen)


def test_rank_zero_alone_warns() -> None:
    assert run_ranks(_two_ranks, 2, 0, timeout=60) == [1, 0]
