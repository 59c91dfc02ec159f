"""``plan``'s ``--ns-algorithm``, the Llama-3.1-405B preset, and ``--normuon``, which the cost model
cannot price and which is therefore refused with what it would change."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from muon_dtensor.planning.costmodel import LLAMA31_405B, predict, transformer_shapes
from muon_dtensor.tools.plan_command import main, parse_args

SMALL = ["--layers", "2", "--dim", "256", "--gpus", "4"]  # MLP matrices 4:1, where gram runs


def test_ns_algorithm_reaches_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--ns-algorithm", "gram", "--json"]) == 0
    gram = json.loads(capsys.readouterr().out)["prediction"]
    assert gram == asdict(predict(transformer_shapes(2, 256), 4, ns_algorithm="gram"))
    assert gram["newton_schulz"] < predict(transformer_shapes(2, 256), 4).newton_schulz
    assert main([*SMALL, "--ns-algorithm", "gram"]) == 0
    assert "5 gram Newton-Schulz steps" in capsys.readouterr().out


def test_405b_preset() -> None:
    args = parse_args(["--model", "llama3.1-405b", "--gpus", "512"])
    assert args.shapes == LLAMA31_405B and len(args.shapes) == 882


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--normuon"], "--normuon: the cost model does not price NorMuon (its extra per matrix: one column"),
        (["--ns-split", "--ns-algorithm", "gram"], "Muon splits only the standard iteration"),
        (["--ns-algorithm", "newton"], "invalid choice: 'newton'"),
    ],
)
def test_refused_with_the_reason(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main([*SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--matmul-tflops", "nan"], "argument --matmul-tflops: nan is not a finite number > 0"),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: 0 is below 1"),
        (["--latency-us", "-5"], "argument --latency-us: -5 is not a finite number >= 0"),
        (["--ns-steps", "1000000000"], "argument --ns-steps: 1,000,000,000 is above the limit of 1,000"),
        (["--kv-rows", "0"], "argument --kv-rows: 0 is below 1"),
        (["--hsdp", "2", "--tp", "2"], "--hsdp and --tp: not an option of the cost model's step"),
    ],
)
def test_out_of_range_flags_are_named(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_layouts_above_the_limit_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--shard", "100000", "--replicate", "100"]) == 2
    assert "= 10,000,000 GPUs is above the limit of 131,072" in capsys.readouterr().err
    assert main(["--layers", "1000000000", "--dim", "64", "--gpus", "8"]) == 2
    assert "argument --layers: 1,000,000,000 is above the limit of 10,000" in capsys.readouterr().err


def test_ns_split_takes_auto_or_off() -> None:
    assert parse_args([*SMALL, "--ns-split", "auto"]).ns_split == "auto"
    assert parse_args([*SMALL, "--ns-split"]).ns_split == "auto"
    assert parse_args([*SMALL, "--ns-split", "off"]).ns_split == parse_args(SMALL).ns_split == "off"
