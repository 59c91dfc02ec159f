"""``python -m muon_dtensor plan``: in process, its printed numbers against ``costmodel.predict``."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace

import pytest

from muon_dtensor.__main__ import main as package_main
from muon_dtensor.planning.costmodel import (
    CURRENT,
    LLAMA3_8B,
    LLAMA3_70B,
    Hardware,
    predict,
    transformer_shapes,
)
from muon_dtensor.tools.plan_command import main

SMALL = ["--layers", "2", "--dim", "256"]  # 12 matrices: each plan below takes milliseconds


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _table(out: str) -> dict[str, float]:
    """The ``| part | ms |`` rows of the report."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^\| ([^|]+?) \| ([\d.]+) \|$", out, re.M)}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def test_report_prints_predict_for_one_shard_group(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, "--model", "llama3-8b", "--gpus", "16")
    p = predict(LLAMA3_8B, 16)
    assert _table(out) == {
        "step": _ms(p.total),
        "Newton-Schulz (busiest rank)": _ms(p.newton_schulz),
        "all-to-alls": _ms(p.comm),
        "elementwise (memory-bound)": _ms(p.memory),
        "host (eager ops)": _ms(p.host),
    }
    assert f"collectives per step: {p.collectives};" in out
    assert f"{p.bytes_sent_mean / 1e6:,.1f} MB mean, {p.bytes_sent_max / 1e6:,.1f} MB max" in out
    assert f"imbalance {p.imbalance:.3f}" in out
    redundant = predict(LLAMA3_8B, 16, mode="redundant").total
    assert f"(mode redundant): {redundant * 1e3:.1f} ms." in out
    assert "224 hidden matrices" in out and "16 GPUs = 1 replica group(s) x 16 ranks" in out


def test_replicas_do_not_change_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    """HSDP with owners per replica: 4 replica groups of 8 ranks run the step of one 8-rank shard group."""
    hsdp = json.loads(_run(capsys, *SMALL, "--gpus", "32", "--shard", "8", "--owners", "replica", "--json"))
    assert hsdp["layout"] == {"gpus": 32, "shard": 8, "replicate": 4}
    assert hsdp["prediction"] == asdict(replace(predict(transformer_shapes(2, 256), 8), replicas=4))
    same = json.loads(
        _run(capsys, *SMALL, "--shard", "8", "--replicate", "4", "--owners", "replica", "--json")
    )
    assert same == hsdp
    flat = json.loads(_run(capsys, *SMALL, "--gpus", "32", "--json"))
    assert flat["layout"]["shard"] == 32 and flat["prediction"]["world_size"] == 32


def test_flags_reach_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL, "--kv-rows", "64", "--ffn", "704", "--gated", "--gpus", "16", "--mode", "gather"]
    argv += ["--matmul-tflops", "600", "--inter-node-gbps", "25", "--latency-us", "20"]
    argv += ["--ns-steps", "4", "--max-round-bytes", "0", "--json"]
    got = json.loads(_run(capsys, *argv))
    hw = Hardware.h200(matmul_flops=600e12, inter_node_bandwidth=25e9, collective_latency=20e-6)
    assert got["hardware"] == pytest.approx(asdict(hw))
    shapes = transformer_shapes(2, 256, kv_rows=64, ffn=704, gated=True)
    impl = replace(CURRENT, max_round_bytes=None)
    want = predict(shapes, 16, Hardware(**got["hardware"]), mode="gather", impl=impl, ns_steps=4)
    assert got["prediction"] == asdict(want)


@pytest.mark.slow
def test_ns_split_reaches_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``--ns-split`` is ``predict(..., split=True)``, without it ``split=False``: Llama-3-70B on 1,024
    GPUs, where splits pay (how much shorter: test_split_plan's test_split_shortens_the_70b_step_at_1024)."""
    argv = ["--model", "llama3-70b", "--gpus", "1024", "--json"]
    plain = json.loads(_run(capsys, *argv))["prediction"]
    split = json.loads(_run(capsys, *argv, "--ns-split"))["prediction"]
    assert split == asdict(predict(LLAMA3_70B, 1024, split=True))
    assert plain == asdict(predict(LLAMA3_70B, 1024)) and split["total"] < plain["total"]
    assert "ns_split auto" in _run(capsys, "--model", "llama3-70b", "--gpus", "1024", "--ns-split")


@pytest.mark.parametrize(
    "argv",
    [
        [],  # neither --gpus nor --shard
        ["--gpus", "64", "--shard", "7"],
        ["--gpus", "8", "--replicate", "3"],
        ["--gpus", "64", "--shard", "8", "--replicate", "4"],
        ["--gpus", "0"],
        ["--gpus", "8", "--layers", "2"],  # a custom model needs --dim too
        ["--gpus", "8", "--model", "gpt-5"],
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err


def test_package_entry_point_dispatches(capsys: pytest.CaptureFixture[str]) -> None:
    assert package_main(["plan", *SMALL, "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["gpus"] == 4
    assert package_main(["nonsense"]) == 2
    assert "{demo,plan}" in capsys.readouterr().err
    assert package_main([]) == 2
    assert package_main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
