"""The CPU bf16 probe (``muon_dtensor.demo.cpu``) and what follows from it: the demo's Newton-Schulz
dtype (fp32 where bf16 is emulated, printed) and bench_step.py's matrix-set size (within its budget)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from muon_dtensor.demo.cpu import EMULATED, ENV, NATIVE, CpuProbe, classify, probe
from muon_dtensor.demo.round_robin import RoundRobinMuon
from muon_dtensor.demo.run import environment, precision

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.budget import DEFAULT, choose_size, step_equivalents  # noqa: E402
from tests.conftest import DemoRun  # noqa: E402

# One-thread rates quoted in the issue: AVX512-BF16 (native) and AVX2-only (emulated) CPUs.
NATIVE_RATES, EMULATED_RATES = (215.0, 74.0), (1.3, 74.0)


def test_the_environment_names_the_cpus_family_and_model(tmp_path: Path) -> None:
    # A virtual machine's model name may say only "AMD EPYC"; the family and model tell a Zen 3
    # (AVX2 only, bf16 emulated) from a Zen 4, whose suite ran in half the time (stop 62).
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\nprocessor\t: 1\nmodel name\t: other\n"
    )
    env = environment(cpuinfo)
    assert env["cpu"] == "AMD EPYC (cpu family 25, model 17)"
    assert env["avx512_bf16"] and not env["amx_bf16"]
    assert environment(tmp_path / "absent")["cpu"]  # no /proc: the platform's name, flags unknown


def test_classify_given_rates() -> None:
    assert classify(*NATIVE_RATES) == NATIVE
    assert classify(*EMULATED_RATES) == EMULATED
    assert classify(60.0, 100.0) == NATIVE  # bf16 a little slower than fp32 is not emulation
    assert classify(40.0, 100.0) == EMULATED


def test_probe_measures_and_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    measured = probe(size=64, seconds=0.0)
    assert measured.bf16_gflops > 0 and measured.fp32_gflops > 0 and not measured.forced
    assert measured.kind == classify(measured.bf16_gflops, measured.fp32_gflops)
    monkeypatch.setenv(ENV, EMULATED)
    forced = probe(size=64, seconds=0.0)
    assert forced.kind == EMULATED and forced.forced and forced.ns_dtype == torch.float32
    assert probe(NATIVE, size=64, seconds=0.0).ns_dtype == torch.bfloat16  # the argument wins
    monkeypatch.setenv(ENV, "avx2")
    with pytest.raises(ValueError, match="MUON_DTENSOR_CPU_BF16 should be 'native' or 'emulated'"):
        probe(size=64, seconds=0.0)


def test_demo_choice_follows_the_probe() -> None:
    dtype, line = precision(CpuProbe(*EMULATED_RATES, kind=classify(*EMULATED_RATES)))
    assert dtype == "float32"
    assert "CPU bf16 emulated (measured)" in line and "1.3 GFLOP/s in bf16, 74.0 in fp32" in line
    assert "ns_dtype=torch.float32" in line
    dtype, line = precision(CpuProbe(*NATIVE_RATES, kind=classify(*NATIVE_RATES)))
    assert dtype == "bfloat16" and "215.0 GFLOP/s in bf16" in line and "Newton-Schulz in bfloat16" in line
    assert precision(None)[0] == "bfloat16"  # GPUs
    # the round-robin double runs the same dtype as muon_dtensor
    assert (
        RoundRobinMuon([torch.nn.Parameter(torch.ones(2, 2))], ns_dtype=dtype).config.dtype == torch.bfloat16
    )
    fp32 = RoundRobinMuon([torch.nn.Parameter(torch.ones(2, 2))], ns_dtype="float32")
    assert fp32.config.dtype == torch.float32


@pytest.mark.slow
def test_demo_forced_emulated_runs_newton_schulz_in_fp32_and_says_so(demo_emulated_qk_clip: DemoRun) -> None:
    """The session's forced-emulated demo run (it also has --qk-clip, which test_qk_clip reads)."""
    done = demo_emulated_qk_clip
    assert done.returncode == 0, done.failure()
    assert f"CPU bf16 emulated (forced by {ENV}=emulated)" in done.stdout
    assert "runs Newton-Schulz in float32 (ns_dtype=torch.float32)" in done.stdout
    environment = done.results()["environment"]
    assert environment["ns_dtype"] == "float32" and environment["bf16_probe"]["kind"] == EMULATED


def _passes(world_sizes: list[int] = [2]) -> float:  # noqa: B006
    return step_equivalents(argparse.Namespace(warmup=2, steps=7), world_sizes, cores=2)


def test_bench_step_keeps_the_default_set_on_native_bf16() -> None:
    choice = choose_size(_passes(), CpuProbe(*NATIVE_RATES, kind=NATIVE), budget_s=900)
    assert (choice.layers, choice.width) == DEFAULT and "the default set" in choice.reason


def test_bench_step_shrinks_the_set_where_bf16_is_emulated() -> None:
    choice = choose_size(_passes(), CpuProbe(*EMULATED_RATES, kind=EMULATED), budget_s=900)
    assert (choice.layers, choice.width) != DEFAULT and choice.estimate_s <= 450
    assert "would take about" in choice.reason and "not comparable" in choice.reason
    # forcing "emulated" on a native CPU plans with the emulated rate, so the path is testable here
    forced = choose_size(_passes(), CpuProbe(*NATIVE_RATES, kind=EMULATED, forced=True), budget_s=900)
    assert (forced.layers, forced.width) == (choice.layers, choice.width)


def _session_dtypes(ns_dtype: str) -> tuple[list[str], str]:
    """On a rank: the Newton-Schulz dtype of each demo session built from a RunSpec."""
    from muon_dtensor.demo.round_robin import RoundRobinSession
    from muon_dtensor.demo.train import RunSpec, ShardedSession, _session

    spec = RunSpec(
        "muon_dtensor", "fsdp", steps=1, micro_batches=1, micro_size=1, folder="", ns_dtype=ns_dtype
    )
    ours, theirs = _session(spec), _session(replace(spec, optimizer="round_robin"))
    assert isinstance(ours, ShardedSession) and isinstance(theirs, RoundRobinSession)
    groups = sorted({g["ns_dtype"] for g in ours.opt.param_groups if g["algorithm"] == "muon"})
    return groups, str(theirs.muon.config.dtype)


@pytest.mark.parametrize("ns_dtype", ["float32", "bfloat16"])
def test_demo_sessions_use_the_chosen_dtype(ns_dtype: str) -> None:
    from tests.harness.ranks import run_ranks

    groups, theirs = run_ranks(_session_dtypes, 1, ns_dtype)[0]
    assert groups == [ns_dtype] and theirs == f"torch.{ns_dtype}"
