"""``benchmarks/gpu_check.py``, the one prepared GPU check, on CPU: ``--dry-run`` runs every part
with tiny shapes and writes one JSON file with a status per part; the parts that run on CPU
produce numbers (a: the batch-independence comparisons, b: the flops arithmetic, c: the op
counts), the CUDA-only ones say why they were skipped, and the full run's printed estimate fits
the 8 minutes the check is sized for."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpucheck.estimate import estimate, fit_budget, full_settings
from benchmarks.gpucheck.ns_speed import ns_config
from muon_dtensor.numerics.newton_schulz import ns_flops, orthogonalize_flops
from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STATUSES = {"ok", "skipped", "error"}


def device_command() -> str:
    """The one line benchmarks/README.md gives for the GPU machine."""
    lines = [ln.strip() for ln in (ROOT / "benchmarks" / "README.md").read_text().splitlines()]
    (line,) = [ln for ln in lines if "benchmarks/gpu_check.py" in ln and ln.startswith("PYTHONPATH=")]
    return line


def run_script(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    """The README's line as it stands, with ``args`` appended, run by bash from the repository root
    with this interpreter as its ``python3``, ``$OUT`` set and no CUDA device."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "python3"  # a script, not a link: a venv's interpreter finds its venv by its path
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env = background.environ(OUT=str(out), CUDA_VISIBLE_DEVICES="", PYTHONPATH="")
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    line = " ".join([device_command(), *args])
    return background.run(["bash", "-c", line], env=env, cwd=ROOT, timeout=120)


def test_the_device_command_is_one_line_importing_from_the_tree() -> None:
    line = device_command()
    assert line.startswith("PYTHONPATH=$PWD timeout ") and '--out "$OUT/gpu_check.json"' in line
    assert int(line.split()[2]) < 600  # inside the device machine's 10-minute command limit


@background.job("gpu_check_dry_run")
def _dry_run(out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = run_script("--dry-run", out=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def gpu_check_dry_run() -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The dry run, in the background of the session (tests/harness/background.py)."""
    return background.result("gpu_check_dry_run")


@pytest.mark.slow
def test_every_part_has_a_status(gpu_check_dry_run: tuple[Any, dict[str, Any]]) -> None:
    _, payload = gpu_check_dry_run
    parts = payload["parts"]
    assert sorted(parts) == ["a", "b", "c", "d", "e"]
    for key, entry in parts.items():
        assert entry["status"] in STATUSES, key
        assert entry["seconds"] >= 0
        assert entry["status"] != "error", entry.get("error")
    assert payload["dry_run"] is True
    assert payload["full_run_estimate"]["assumed_bf16_tflops"] > 0


@pytest.mark.slow
def test_batch_independence_compares_every_batch_and_position(
    gpu_check_dry_run: tuple[Any, dict[str, Any]],
) -> None:
    result = gpu_check_dry_run[1]["parts"]["a"]["result"]
    assert result["shapes_checked"] == len(result["rows"]) == 3
    for row in result["rows"].values():
        assert isinstance(row["batch_independent"], bool)
        assert set(row["batches"]) == {"2", "4", "8"}
        for entry in row["batches"].values():
            assert set(entry["vs_lone"]) == {"first", "middle", "last"}
            for cmp in entry["vs_lone"].values():
                assert isinstance(cmp["equal"], bool) and math.isfinite(cmp["max_abs_diff"])
        assert isinstance(row["torch_optim_muon"]["equal"], bool)


@pytest.mark.slow
def test_ns_speed_rows_hold_the_flops_arithmetic(gpu_check_dry_run: tuple[Any, dict[str, Any]]) -> None:
    result = gpu_check_dry_run[1]["parts"]["b"]["result"]
    peak = result["peak"]
    assert peak["tflops"] == pytest.approx(
        2 * peak["n"] ** 3 / (statistics.median(peak["times_ms"]) * 1e-3) / 1e12
    )
    rows = result["rows"]
    assert {r["algorithm"] for r in rows} == {"standard", "gram"}
    for r in rows:
        shape = tuple(r["shape"])
        assert r["flops_per_matrix"] == orthogonalize_flops(shape, ns_config(r["algorithm"]))
        assert r["tflops"] == pytest.approx(
            r["batch"] * r["flops_per_matrix"] / (r["median_ms"] * 1e-3) / 1e12
        )
        standard = r["batch"] * ns_flops(shape, 5) / (r["median_ms"] * 1e-3) / 1e12
        assert r["standard_equivalent_tflops"] == pytest.approx(standard)
        assert r["fraction_of_peak"] == pytest.approx(r["tflops"] / peak["tflops"])
        assert r["finite"]
    ones = [r for r in rows if r["batch_of_one"]]  # the step's own calls: one matrix each
    assert ones and all(r["batch"] == 1 and r["algorithm"] == "standard" for r in ones), ones
    assert all(r["host_over_device"] == pytest.approx(r["host_issue_ms"] / r["median_ms"]) for r in ones)


@pytest.mark.slow
def test_step_part_counts_ops_and_host_time(gpu_check_dry_run: tuple[Any, dict[str, Any]]) -> None:
    result = gpu_check_dry_run[1]["parts"]["c"]["result"]
    assert result["host_model_us_per_op"] == pytest.approx(5.0)
    assert set(result["contenders"]) == {
        "muon_dtensor.Muon",
        "torch.optim.Muon",
        "torch.optim.AdamW fused",
    } | {
        "muon_dtensor.Muon bf16 momentum",
        "muon_dtensor.Muon int8 momentum",
        'muon_dtensor.Muon ns_algorithm="aol"',
    }
    for label, row in result["contenders"].items():
        assert "error" not in row, row
        assert row["ops"] > 0, label
        assert row["host_ms"] > 0 and row["host_us_per_op"] > 0
        assert row["device_ms"] is None  # no CUDA events on CPU
        assert "skipped" in row["sync_check"]
    assert result["contenders"]["muon_dtensor.Muon"]["top_op_names"]
    for label in ("bf16 momentum", "int8 momentum", 'ns_algorithm="aol"'):
        diff = result["contenders"][f"muon_dtensor.Muon {label}"]["max_abs_param_diff_to_float32_momentum"]
        assert math.isfinite(diff), label


@pytest.mark.slow
def test_cuda_only_parts_are_skipped_with_a_reason(gpu_check_dry_run: tuple[Any, dict[str, Any]]) -> None:
    parts = gpu_check_dry_run[1]["parts"]
    d, e = parts["d"], parts["e"]
    assert d["status"] == "skipped" and "CUDA" in d["reason"], d
    assert all(d["result"]["replay_equals_eager_per_step"]), d  # the harness, with eager steps
    assert e["status"] == "skipped" and "NCCL" in e["reason"], e
    runs = e["result"]["runs"]
    assert len(runs) == 4 and all(r.get("bitwise_equal") for r in runs.values()), runs  # the harness on gloo


@pytest.mark.slow
def test_printed_full_run_estimate_fits_eight_minutes(gpu_check_dry_run: tuple[Any, dict[str, Any]]) -> None:
    proc, payload = gpu_check_dry_run
    found = re.search(r"estimate for the full run: (\d+) s", proc.stdout)
    assert found, proc.stdout[:2000]
    assert int(found.group(1)) < 480
    assert payload["full_run_estimate"]["total_s"] < 480
    assert "| part | status |" in proc.stdout


def test_budget_trims_repetitions_first_then_compiles() -> None:
    assert not fit_budget(full_settings(420.0, compile=True)).trims  # the default fits as it is
    tight = fit_budget(full_settings(230.0, compile=True))
    assert tight.compile and tight.reps < 10 and estimate(tight)["total_s"] <= 230.0
    tighter = fit_budget(full_settings(150.0, compile=True))
    assert not tighter.compile and estimate(tighter)["total_s"] <= 150.0
    assert tighter.trims == ["compile: True -> False"]  # fewer repetitions no longer needed


@background.job("gpu_check_without_cuda")
def _full_run(out: Path) -> tuple[subprocess.CompletedProcess[str], bool]:
    return run_script(out=out), (out / "gpu_check.json").exists()


@pytest.fixture
def gpu_check_without_cuda() -> tuple[subprocess.CompletedProcess[str], bool]:
    return background.result("gpu_check_without_cuda")


@pytest.mark.slow
def test_full_run_without_cuda_exits_2(
    gpu_check_without_cuda: tuple[subprocess.CompletedProcess[str], bool],
) -> None:
    proc, wrote = gpu_check_without_cuda
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not wrote


def test_a_part_past_the_budget_is_stopped_and_the_next_skipped() -> None:
    """``--budget-s`` is a deadline: a part still running when it ends is stopped (its per-case
    ``except Exception`` does not swallow the stop), and a part after it does not start."""
    from benchmarks.gpucheck.common import run_part
    from benchmarks.gpucheck.estimate import dry_settings

    def slow_cases(_: Any) -> dict[str, Any]:
        for _ in range(50):
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001, S112 - a part's per-case handler
                continue
        return {}

    settings = dry_settings(0.5)
    start = time.perf_counter()
    late = run_part("late", slow_cases, settings)
    assert late["status"] == "error" and "--budget-s" in late["error"], late
    assert time.perf_counter() - start < 3.0
    after = run_part("after", slow_cases, settings)
    assert after["status"] == "skipped" and "--budget-s" in after["reason"], after


def test_gpu_ns_records_a_failing_case_and_writes_after_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """gpu_ns.py without a GPU, its measuring functions stood in for: a case that raises is
    recorded and the others still run; the JSON is there after the first case already."""
    from benchmarks import gpu_ns

    out = tmp_path / "gpu_ns.json"
    seen: list[bool] = []

    def run_case(
        shape: tuple[int, int], batch: int, compiled: bool, reps: int, peak: float
    ) -> dict[str, Any]:
        seen.append(out.exists())
        if compiled:
            raise RuntimeError("compile failed")
        return {"shape": list(shape), "batch": batch, "compiled": False, "tflops": 1.0, "finite": True}

    monkeypatch.setattr(gpu_ns, "require_cuda", lambda: None)
    monkeypatch.setattr(gpu_ns, "system_info", lambda: {"gpu": "none"})
    monkeypatch.setattr(gpu_ns, "matmul_peak", lambda reps: {"tflops": 2.0})
    monkeypatch.setattr(gpu_ns, "run_case", run_case)
    monkeypatch.setattr(gpu_ns, "format_table", lambda *a: "")
    monkeypatch.setattr(gpu_ns, "goal_verdict", lambda rows: {})
    gpu_ns.main(["--out", str(out)])
    payload = json.loads(out.read_text())
    assert len(payload["rows"]) == len(payload["errors"]) == len(gpu_ns.SHAPES)
    assert all("compile failed" in e["error"] for e in payload["errors"])
    assert payload["verdict"] == "FAIL" and all(seen)
