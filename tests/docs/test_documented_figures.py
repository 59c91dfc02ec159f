"""Every figure README.md and docs/ quote about the demo and about torch.optim.Muon comes from a
results file or from a test here, and fails this file when the text and the source disagree.

- The README's demo sample output is regenerated, line by line, from the results file the demo
  wrote (``benchmarks/results/demo_fsdp_2to1.json``), with the demo's own report functions.
- The README's 2 -> 4 resume figure and the demo's time are those results files' figures.
- docs/design.md's plan balance is the plan's, computed here.
- The gap to torch.optim.Muon quoted in docs/design.md and docs/migration.md is ``TORCH_MUON_ROUNDINGS``,
  the bound ``test_gap_to_torch_optim_muon`` asserts.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from muon_dtensor import Muon
from muon_dtensor.demo import report
from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO = "benchmarks/results/demo_fsdp_2to1.json"
DEMO_2TO4 = "benchmarks/results/demo_fsdp_2to4.json"

# Parameters of muon_dtensor.Muon and torch.optim.Muon, fed the same gradients, differ after 10 steps
# by at most this many bfloat16 roundings of the update (lr_adj * 2^-8 each): our elementwise ops
# round float32 values differently before the bfloat16 cast. Measured worst here: 2.98 (torch 2.13 CPU).
TORCH_MUON_ROUNDINGS = 4
LR, STEPS = 0.02, 10
SHAPES = [(32, 48), (64, 16), (40, 40), (96, 96), (128, 32), (16, 128), (300, 7), (7, 300), (200, 100)]
GAP_DOCS = ("docs/design.md", "docs/migration.md")
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


@dataclass(frozen=True)
class Recorded(report.Outcome):
    """An ``Outcome`` rebuilt from results.json: the parameter differences as recorded."""

    differences: dict[int, float] = field(default_factory=dict)

    def difference(self, step: int) -> float:
        return self.differences[step]


def _steps(mapping: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in mapping.items()}


def _recorded(run: dict[str, Any]) -> Recorded:
    differences = _steps(run["largest_parameter_difference"])
    return Recorded(
        straight={"losses": _steps(run["losses_uninterrupted"])},
        resumed={
            "losses": _steps(run["losses_resumed"]),
            "params": dict.fromkeys(differences),
            "kept": tuple(run["momentum_buffers_restored"]),
        },
        save_at=run["save_at"],
        crash_at=run["crash_at"],
        differences=differences,
    )


def _results(path: str) -> dict[str, Any]:
    return json.loads((ROOT / path).read_text())


def _printed(results: dict[str, Any]) -> set[str]:
    """The lines the demo printed for these results, as its report functions print them."""
    args = results["args"]
    w, r = args["world_size"], args["resume_world_size"]
    ours, theirs = _recorded(results["muon_dtensor"]), _recorded(results["round_robin"])
    text = [
        report.step_table(ours, w, r),
        report.step_table(theirs, w, r),
        report.verdict(ours, w, r, args["tolerance"])[1],
        report.twin_table(ours, theirs, 0, 0),
        *report.lessons(ours, theirs, w, r),
    ]
    return {line for block in text for line in block.splitlines()}


def _demo_sample() -> list[str]:
    section = README.read_text().split("\n## The demo\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.+?)\n```", section, re.S)
    assert block, "README.md's demo section lost its sample output"
    assert f"`{DEMO}`" in section, "the README names the results file its sample comes from"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_demo_sample_is_the_results_file() -> None:
    printed = _printed(_results(DEMO))
    checked = [line for line in _demo_sample() if line.startswith(("|", "verdict:", "- "))]
    assert len(checked) >= 12, "the sample shows too little to be checked"
    wrong = [line for line in checked if line not in printed]
    assert not wrong, f"README lines the demo did not print for {DEMO}:\n" + "\n".join(wrong)


def test_results_files_record_typed_arguments_and_the_machine() -> None:
    for path in (DEMO, DEMO_2TO4):
        results = _results(path)
        assert isinstance(results["args"]["world_size"], int) and isinstance(
            results["args"]["tolerance"], float
        )
        assert {"torch", "cpu", "avx512_bf16"} <= results["environment"].keys()


def test_readme_resume_on_4_ranks_is_the_results_file() -> None:
    results = _results(DEMO_2TO4)
    ours = results["muon_dtensor"]
    assert results["args"]["world_size"] == 2 and results["args"]["resume_world_size"] == 4
    largest = max(ours["largest_parameter_difference"].values())
    after = results["args"]["steps"] - ours["save_at"]
    text = " ".join(README.read_text().split())
    found = re.search(
        r"2 on 4 within float rounding: largest parameter difference ([\d.e-]+) over the (\d+) steps", text
    )
    assert found, "the README's 2 -> 4 sentence changed; update this test with it"
    assert f"`{DEMO_2TO4}`" in text
    assert f"{float(found.group(1)):.1e}" == f"{largest:.1e}", (
        f"README {found.group(1)}, {DEMO_2TO4} {largest:.1e}"
    )
    assert int(found.group(2)) == after


def test_readme_demo_time_is_the_results_file() -> None:
    text = " ".join(README.read_text().split())
    found = re.search(rf"CPU is fine: (\d+) s on a 2-core CPU, `{re.escape(DEMO)}`", text)
    assert found, "the README's demo time sentence changed; update this test with it"
    results = _results(DEMO)
    assert int(found.group(1)) == round(results["seconds"]) and results["environment"]["cpu_count"] == 2


def _adjusted_lr(shape: tuple[int, int], adjust_lr_fn: str | None) -> float:
    rows, cols = shape
    if adjust_lr_fn == "match_rms_adamw":
        return LR * 0.2 * math.sqrt(max(rows, cols))
    return LR * math.sqrt(max(1.0, rows / cols))


def _gaps(seed: int, nesterov: bool, adjust_lr_fn: str | None) -> list[float]:
    """Largest parameter difference per shape after STEPS steps of both optimizers, same gradients."""
    gen = torch.Generator().manual_seed(seed)
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    kwargs: dict[str, Any] = {"lr": LR, "nesterov": nesterov, "adjust_lr_fn": adjust_lr_fn}
    a, b = Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    grads = torch.Generator().manual_seed(seed + 1000)
    for _ in range(STEPS):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=grads)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    return [float((p - q).detach().abs().max()) for p, q in zip(ours, theirs)]


GAP_CASES = [(nesterov, adjust) for nesterov in (True, False) for adjust in (None, "match_rms_adamw")]


def _all_gaps() -> dict[tuple[bool, str | None, int], list[float]]:
    """``_gaps`` of every case and seed: 17 s of one core, run beside the session's in-process tests."""
    return {(n, a, seed): _gaps(seed, n, a) for n, a in GAP_CASES for seed in range(3)}


gaps_to_torch_muon = background.apart("gaps_to_torch_muon", _all_gaps, 1, timeout=600)


@pytest.mark.parametrize("nesterov, adjust_lr_fn", GAP_CASES)
def test_gap_to_torch_optim_muon(
    nesterov: bool, adjust_lr_fn: str | None, gaps_to_torch_muon: list[dict[Any, list[float]]]
) -> None:
    (gaps,) = gaps_to_torch_muon  # one rank's
    for seed in range(3):
        for shape, gap in zip(SHAPES, gaps[nesterov, adjust_lr_fn, seed]):
            rounding = _adjusted_lr(shape, adjust_lr_fn) * 2**-8
            assert gap <= TORCH_MUON_ROUNDINGS * rounding, (
                f"{shape}, seed {seed}: {gap:.2e} = {gap / rounding:.1f} roundings > {TORCH_MUON_ROUNDINGS}"
            )


@pytest.mark.parametrize("doc", GAP_DOCS)
def test_docs_quote_the_tested_gap(doc: str) -> None:
    text = " ".join((ROOT / doc).read_text().split())
    found = re.search(r"at most (\d+) bfloat16 roundings of the update", text)
    assert found, f"{doc} no longer states the gap to torch.optim.Muon in roundings; update this test"
    assert int(found.group(1)) == TORCH_MUON_ROUNDINGS
    example = re.search(r"(\d\.\de-\d) for a square matrix at lr 0\.02", text)
    assert example and f"{float(example.group(1)):.1e}" == f"{TORCH_MUON_ROUNDINGS * LR * 2**-8:.1e}"
    assert "tests/docs/test_documented_figures.py" in text
    assert "1.2e-4" not in text, "the old, untested figure"
    if doc == "docs/design.md":
        assert f"on {dict(enumerate(WORDS)).get(len(SHAPES), len(SHAPES))} shapes" in text


def test_design_plan_balance_is_the_plans() -> None:
    from muon_dtensor.planning.costmodel import LLAMA3_8B, sharded_plan

    text = " ".join((ROOT / "docs" / "design.md").read_text().split())
    found = re.search(
        r"On Llama-3-8B's (\d+) hidden matrices the busiest of 8 ranks does ([\d.]+)x the mean and of 64 ranks "
        r"([\d.]+)x",
        text,
    )
    assert found, "docs/design.md's plan-balance sentence changed; update this test with it"
    assert int(found.group(1)) == len(LLAMA3_8B)
    assert found.group(2) == f"{sharded_plan(LLAMA3_8B, 8).imbalance:.3f}"
    assert found.group(3) == f"{sharded_plan(LLAMA3_8B, 64).imbalance:.3f}"
