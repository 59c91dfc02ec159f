"""``split_params(model, head_dim=d)``: the q, k, v projections get a Muon group of their own with
``head_dim``; output projections and MLPs never do, and every way ``head_dim`` could land on them
through ``split_params``' arguments is refused with the FQNs and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.demo.model import ModelConfig, TinyLM

D, DIM = 4, 16  # head_dim, width: 4 heads


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=True)
        self.k_proj = nn.Linear(DIM, DIM // 2, bias=False)  # 2 kv heads
        self.v_proj = nn.Linear(DIM, DIM // 2, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.mlp = nn.ModuleDict(
            {n: nn.Linear(DIM, DIM, bias=False) for n in ("gate_proj", "up_proj", "down_proj")}
        )
        self.norm = nn.LayerNorm(DIM)


class Llamaish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(32, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.lm_head = nn.Linear(DIM, 32, bias=False)


def _names(group: dict) -> list[str]:
    return [n for n, _ in group["params"]]


def test_qkv_get_their_own_head_dim_group() -> None:
    groups = split_params(Llamaish(), head_dim=D, adamw_options={"lr": 3e-3})
    assert [g["algorithm"] for g in groups] == ["muon", "muon", "adamw"]
    plain, heads, adamw = groups
    assert "head_dim" not in plain and heads["head_dim"] == D and adamw["lr"] == 3e-3
    per_layer = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
    assert _names(heads) == [f"layers.{i}.self_attn.{n}" for i in range(2) for n in per_layer]
    assert _names(plain) == [
        f"layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    ]
    assert "layers.0.self_attn.q_proj.bias" in _names(adamw)  # 1-D stays with AdamW
    # without head_dim nothing changes: one Muon group
    assert [g["algorithm"] for g in split_params(Llamaish())] == ["muon", "adamw"]


def test_head_dim_reaches_only_qkv_in_a_step() -> None:
    """One step with and without ``head_dim``: o_proj and the MLP move bitwise the same, q moves
    differently (its heads were orthogonalized one by one)."""
    moved = []
    for head_dim in (None, D):
        model = Llamaish()
        opt = Muon(split_params(model, head_dim=head_dim), lr=0.02)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        opt.step()
        moved.append(dict(model.named_parameters()))
    for name in ("layers.0.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert torch.equal(moved[0][name], moved[1][name]), name
    q = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(moved[0][q], moved[1][q])


def test_custom_module_names() -> None:
    model = TinyLM(ModelConfig(vocab=64, dim=16, layers=1, heads=4, seq=8))
    groups = split_params(model, head_dim=4, qkv=("q", "k", "v"), adamw=["pos"])
    assert _names(groups[1]) == ["blocks.0.q.weight", "blocks.0.k.weight", "blocks.0.v.weight"]
    assert _names(groups[0]) == ["blocks.0.proj.weight", "blocks.0.up.weight", "blocks.0.down.weight"]


def test_a_pattern_that_reaches_o_proj_or_the_mlp_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not attention heads.*layers\.0\.self_attn\.o_proj\.weight") as e:
        split_params(Llamaish(), head_dim=D, qkv=("*_proj",))
    assert "layers.1.mlp.down_proj.weight" in str(e.value) and "Narrow qkv" in str(e.value)


def test_head_dim_that_reaches_nothing_is_refused() -> None:
    model = TinyLM(ModelConfig(vocab=64, dim=16, layers=1, heads=4, seq=8))  # q, k, v: not default names
    with pytest.raises(ValueError, match=r"head_dim=4 reaches no matrix.*blocks\.0\.q\.weight.*qkv="):
        split_params(model, head_dim=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"qkv": ("q_proj",)}, "needs head_dim"),
        ({"head_dim": 0}, "head_dim must be a positive int"),
        ({"head_dim": True}, "head_dim must be a positive int"),
        ({"head_dim": 3}, r"does not divide the rows of \['layers\.0\.self_attn\.q_proj\.weight \(16, 16\)'"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_params(Llamaish(), **kwargs)


@pytest.mark.integration
def test_a_transposed_conv1d_is_refused() -> None:
    """GPT-2's ``c_attn`` is a ``Conv1D`` with weight ``[in, out]``: its heads are columns."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    model = nn.Module()
    model.query = pytorch_utils.Conv1D(3 * DIM, DIM)
    with pytest.raises(ValueError, match=r"Conv1D.*\['query\.weight'\]"):
        split_params(model, head_dim=D)


def test_head_dim_set_by_hand_on_mlp_or_output_rows_warns() -> None:
    """A group built by hand may still set head_dim on matrices whose rows are not heads: the
    optimizer warns, naming them; q, k, v alone pass silently."""
    import warnings

    q = ("layers.0.self_attn.q_proj.weight", torch.nn.Parameter(torch.randn(8, 8)))
    down = ("layers.0.mlp.down_proj.weight", torch.nn.Parameter(torch.randn(8, 16)))
    o = ("layers.0.self_attn.o_proj.weight", torch.nn.Parameter(torch.randn(8, 8)))
    with pytest.warns(
        UserWarning, match=r"head_dim=4 .*down_proj.*o_proj.*split_params\(model, head_dim=d\)"
    ):
        Muon([{"params": [q, down, o], "head_dim": 4}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([{"params": [q], "head_dim": 4}])
