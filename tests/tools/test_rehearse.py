"""``python -m muon_dtensor plan --rehearse``: one rank's real step on the fake backend, at a small size
(a 2-layer model of width 64 on 16 and 32 ranks), its figures beside the cost model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from muon_dtensor.__main__ import main as cli
from muon_dtensor.tools.configs import load_config
from muon_dtensor.tools.rehearse import rehearse

TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_rehearse_prints_measured_beside_model(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--rehearse", config, "--gpus", "16", "--rank", "3", "--head-dim", "0"]) == 0
    out = capsys.readouterr().out
    assert "16 ranks = 1 replica group(s) x 16 shards x 1 TP, rank 3, fake backend" in out
    assert "Muon matrices: 14" in out  # 2 layers x (q, k, v, o, gate, up, down)
    assert "Newton-Schulz run for real" in out
    assert "| collectives | 3 | 3 |" in out  # one check, one all-to-all each way
    assert "c10d::allreduce_ x1: 144 B" in out  # the check's row: 18 int64
    assert "process groups created: 0 by the meshes, 0 by the optimizer" in out
    assert not dist.is_initialized()  # the rehearsal's fake group is gone


def test_rehearse_hsdp_tp_skips_newton_schulz(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--rehearse", config, "--gpus", "32", "--rank", "5", "--hsdp", "2", "--tp", "4"]
    assert cli([*argv, "--skip-ns", "--head-dim", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 replica group(s) x 4 shards x 4 TP" in out
    assert "Newton-Schulz skipped (--skip-ns)" in out
    assert "process groups created: 3 by the meshes" in out  # one per mesh axis


def test_rehearsal_counts(config: str) -> None:
    found = rehearse(load_config(config), 16, 15, steps=1)
    assert found.matrices == 14 and found.local_elements > 0
    assert found.host_ops > 0 and found.predicted_ops > 0
    assert found.modelled_memory == (found.memory["momentum"], found.memory["peak_transient"])


@pytest.mark.parametrize(
    "argv",
    [["--gpus", "16", "--rank", "16"], ["--gpus", "16", "--tp", "3"], ["--gpus", "16", "--steps", "0"]],
)
def test_rehearse_refuses_bad_arguments(config: str, argv: list[str]) -> None:
    assert cli(["plan", "--rehearse", config, *argv]) == 2


def test_rehearse_refuses_a_model_too_large_for_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--rehearse", "llama3-70b", "--gpus", "8", "--rank", "0"]) == 2
    assert "rehearse on more ranks" in capsys.readouterr().err
