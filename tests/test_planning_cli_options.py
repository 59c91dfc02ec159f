"""``plan``'s ``--ns-algorithm``, the Llama-3.1-405B preset, and ``--normuon``, which the cost model
cannot price and which is therefore refused with what it would change."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from muon_dtensor.planning.cli import main, parse_args
from muon_dtensor.planning.costmodel import LLAMA31_405B, predict, transformer_shapes

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
