"""``python -m muon_dtensor plan --check``: layouts, plans and per-rank memory on meta tensors, with no
processes; exit 1 naming the parameter where a layout cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from muon_dtensor.__main__ import main as entry
from muon_dtensor.tools.launch_check import check, meta_model
from muon_dtensor.tools.plan_command import main as plan_main

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def _meta(*shapes: tuple[int, int]) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(cols, rows, bias=False) for rows, cols in shapes))


def _chunks(rows: int, ranks: int) -> list[int]:
    """torch.chunk's rows per rank, as FSDP2's Shard(0) cuts them."""
    size = -(-rows // ranks)
    return [max(0, min(size, rows - r * size)) for r in range(ranks)]


def test_leading_dimension_72_on_16_ranks() -> None:
    """prime-rl's shape: 72 rows on 16 ranks leave ranks 14 and 15 with 2 and 0 rows."""
    found = check(_meta((72, 48), (48, 72)), 16)
    rows = _chunks(72, 16)
    assert rows[-3:] == [5, 2, 0]
    assert found.momentum == tuple(4 * (r * 48 + c * 72) for r, c in zip(rows, _chunks(48, 16)))
    assert found.matrices == 2 and all(p > 0 for p in found.peak)
    (plan,) = found.plans
    assert plan.group_size == 16 and sorted(o for rnd in plan.rounds for o in rnd.owners) == [0, 1]


@pytest.mark.parametrize("n", [8, 16])
def test_one_row_weights(n: int) -> None:
    """[1, N] weights on N ranks: rank 0 holds the row, every other rank nothing."""
    found = check(_meta((1, n), (n, 1), (1, n)), n)
    assert found.momentum[0] == 4 * (n + 1 + n) and set(found.momentum[1:]) <= {4}
    assert found.momentum[1:] == tuple(4 * (1 if r < n else 0) for r in range(1, n))


def test_cli_on_a_config_json_with_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL | {"num_local_experts": 72, "moe_intermediate_size": 32}))
    assert entry(["plan", "--check", str(path), "--gpus", "16"]) == 0
    out = capsys.readouterr().out
    # per layer q, k, v, o, the router, and 72 experts in each of three stacks (gate, up, down)
    assert f"Muon: {2 * (5 + 3 * 72):,} matrices" in out and "OK:" in out


def test_cli_with_hsdp_and_tp(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": SMALL}))
    assert entry(["plan", "--check", str(path), "--gpus", "16", "--hsdp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "16 GPUs = 2 replica group(s) x 4 shards x 2 TP ranks" in out


def test_layout_that_cannot_run_names_the_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry(["plan", "--check", "llama3-8b", "--gpus", "8", "--head-dim", "96"]) == 1
    err = capsys.readouterr().err
    assert "head_dim=96 does not divide the rows of" in err and "layers.0.self_attn.q_proj.weight" in err


def test_a_bad_config_field_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL | {"num_hidden_layers": 0}))
    assert entry(["plan", "--check", str(path), "--gpus", "8"]) == 2  # a config it cannot check
    assert "'num_hidden_layers' must be a positive integer" in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry(["plan", "--check", "llama3-8b", "--gpus", "6", "--tp", "4"]) == 2
    assert "must be a positive multiple" in capsys.readouterr().err
    assert entry(["plan", "--check", "no-such-model", "--gpus", "8"]) == 2
    assert "'no-such-model' is neither a preset" in capsys.readouterr().err


def test_plan_cli_prints_the_same_memory_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --model`` and ``plan --check`` agree on a preset's Muon figures."""
    assert plan_main(["--model", "llama3-8b", "--gpus", "16", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["memory"]
    found = check(
        meta_model(
            {
                "vocab_size": 128256,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
            }
        ),
        16,
    )
    assert figures["momentum"] == {"min": min(found.momentum), "max": max(found.momentum)}
    assert figures["peak_transient"] == {"min": min(found.peak), "max": max(found.peak)}


def test_the_configs_head_dim_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """q, k, v per head of the config's head_dim (4 + 2 + 2 heads per layer), whole with --head-dim 0."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL | {"head_dim": 16}))
    assert entry(["plan", "--check", str(path), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "Muon: 24 matrices" in out and "per head of 16 rows (the config's head_dim" in out
    assert entry(["plan", "--check", str(path), "--gpus", "8", "--head-dim", "0"]) == 0
    out = capsys.readouterr().out
    assert "Muon: 14 matrices" in out and "Muon's q, k, v: whole matrices" in out


def test_ns_split_auto_is_priced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    one = {"hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 1, "num_attention_heads": 32}
    path.write_text(json.dumps(one | {"vocab_size": 1000}))
    assert entry(["plan", "--check", str(path), "--gpus", "16", "--ns-split", "auto"]) == 0
    out = capsys.readouterr().out
    assert 'with ns_split="auto" (--ns-split auto): modelled step' in out and "suggestion" not in out
    assert check(meta_model(one | {"vocab_size": 1000}), 16).imbalance > 1.5
    assert entry(["plan", "--check", str(path), "--gpus", "16"]) == 0  # unbalanced: a suggestion
    assert "suggestion: owners are unbalanced" in capsys.readouterr().out
    assert entry(["plan", "--check", str(path), "--gpus", "2"]) == 0  # balanced: none
    assert "suggestion" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "is not a readable JSON file"),
        (json.dumps({"text_config": [1]}), "its text_config holds a JSON list"),
        (
            json.dumps(SMALL | {"num_attention_heads": 128}),
            "'num_attention_heads' (128) is above 'hidden_size'",
        ),
        (json.dumps(SMALL | {"hidden_size": True}), "'hidden_size' must be a positive integer but is True"),
        (
            json.dumps(SMALL | {"num_hidden_layers": 10_000, "num_local_experts": 60_000}),
            "1,800,050,000 Muon matrices, above the limit of 1,048,576",
        ),
    ],
)
def test_configs_it_cannot_check_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    assert entry(["plan", "--check", str(path), "--gpus", "8"]) == 2
    assert message in capsys.readouterr().err


def test_check_takes_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` refused ``--ep``; it now lays the stacks out as torchtitan does (experts over ep,
    rows over gpus / ep) and prices the launch's one step as dense then expert groups."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL | {"num_local_experts": 8, "moe_intermediate_size": 32}))
    assert entry(["plan", "--check", str(path), "--gpus", "16", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert "x EP 4 for the experts (gpus / ep = 4 ranks each)" in out and "over ep 4" in out
    # the experts' plan over 16 ranks: each expert's rows on its 4 ranks, owned by one of them, so
    # the 2 x 3 x 8 expert matrices are 3 per rank
    assert "16 ranks: 1.000, 3-3 matrices per rank" in out, out


@pytest.mark.parametrize(
    ("config", "gpus", "ep", "message"),
    [
        ("llama3-8b", "64", "8", "--ep 8: the model has no expert stacks"),
        ("deepseek-v3", "64", "3", "--ep 3 must divide --gpus 64"),
        ("deepseek-v3", "48", "3", "--ep 3 does not divide deepseek-v3's 256 experts"),
    ],
)
def test_check_refuses_an_ep_it_cannot_lay_out(
    config: str, gpus: str, ep: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any layout is built: exit 2 naming --ep, its value and the fix."""
    assert entry(["plan", "--check", config, "--gpus", gpus, "--ep", ep]) == 2
    assert message in capsys.readouterr().err
