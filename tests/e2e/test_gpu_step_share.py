"""``benchmarks/gpu_step_share.py`` on CPU, tiny: each arm builds and steps, the table prints each
row's ratios, and on CPU (one matrix at a time) the round bound changes no bit of the step."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from benchmarks.gpu_step_share import ARMS, DRY, build, predicted, print_table, run_arm
from muon_dtensor import Muon
from muon_dtensor.demo.model import TinyLM
from muon_dtensor.planning.step_share import flop_share

pytestmark = pytest.mark.slow


def test_each_arm_steps_and_the_table_prints_its_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    (name, (cfg, batches)), cpu = next(iter(DRY.items())), torch.device("cpu")
    rows: list[dict[str, Any]] = [{"model": name, "tokens": batches[0] * cfg.seq, "arm": arm} for arm in ARMS]
    for row in rows:
        row.update(run_arm(str(row["arm"]), cfg, batches[0], cpu, reps=1, warmup=1))
        row["predicted_share"] = predicted(cfg, batches[0] * cfg.seq)
        assert row["opt_ms"] > 0 and row["fwd_bwd_ms"] > 0 and math.isfinite(row["loss_last"])
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["muon_dtensor.Muon"]["loss_last"] == by_arm["muon_dtensor.Muon 64 MiB rounds"]["loss_last"]
    print_table(rows)
    table = capsys.readouterr().out.splitlines()
    pair = [ln for ln in table if "| torch.optim.Muon + fused AdamW |" in ln]
    assert len(table) == 2 + len(ARMS) and pair and "| 1.00 | " in pair[0]


def test_arms_hold_what_they_say_and_the_prediction_is_the_flop_share() -> None:
    cfg = next(iter(DRY.values()))[0]
    model = TinyLM(cfg)
    bound = build("muon_dtensor.Muon 64 MiB rounds", model, fused=False)
    assert isinstance(bound, Muon) and bound.defaults["max_round_bytes"] == 64 << 20
    adamw = build("fused AdamW", model, fused=False)
    assert isinstance(adamw, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in adamw.param_groups) == len(list(model.parameters()))
    d, h = cfg.dim, cfg.mlp_ratio * cfg.dim
    hidden = [(d, d)] * 4 + [(h, d), (d, h)]
    n = cfg.layers * (4 * d * d + 2 * d * h) + cfg.vocab * d
    assert predicted(cfg, 4096) == flop_share(hidden * cfg.layers, n, 1, 4096) < predicted(cfg, 1024) < 1
