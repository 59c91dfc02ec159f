"""The ``MUON_DTENSOR_NS_BATCH`` switch, and the host-work count of ``benchmarks/bench_host.py``.

``always`` runs the CUDA path's batched Newton-Schulz on CPU so CPU runs count its ops; with one BLAS
thread its bits are the one-at-a-time path's. The benchmark's counting function is checked on a tiny
FSDP model: the collectives per step do not grow with depth.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_host
from muon_dtensor import Muon
from muon_dtensor.numerics.newton_schulz import BATCH_ENV, batching
from tests.harness import background
from tests.harness.ranks import run_apart, run_ranks


@pytest.mark.parametrize(
    ("value", "cpu", "cuda"),
    [
        (None, False, True),
        ("", False, True),
        ("auto", False, True),
        ("always", True, True),
        ("never", False, False),
    ],
)
def test_batching_follows_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None, cpu: bool, cuda: bool
) -> None:
    if value is None:
        monkeypatch.delenv(BATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(BATCH_ENV, value)
    assert (batching("cpu"), batching("cuda")) == (cpu, cuda)


def test_a_bad_value_is_refused_with_the_variable_the_value_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(BATCH_ENV, "Always")
    with pytest.raises(
        ValueError, match=r"MUON_DTENSOR_NS_BATCH must be one of auto, always, never.*'Always'"
    ):
        batching("cpu")


@pytest.mark.slow
def test_a_bad_value_stops_the_import() -> None:
    """Every rank fails at import, before any collective (a rank that owns no matrix never asks)."""
    env = {**os.environ, BATCH_ENV: "sometimes", "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", "import muon_dtensor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "MUON_DTENSOR_NS_BATCH" in done.stderr and "'sometimes'" in done.stderr


def _step(monkeypatch: pytest.MonkeyPatch, value: str) -> tuple[list[torch.Tensor], list[str]]:
    """Two Muon steps on four same-shape wide matrices, three tall ones and a lone one; the final
    parameters and the names of the ops of the second step."""
    monkeypatch.setenv(BATCH_ENV, value)
    gen = torch.Generator().manual_seed(0)
    shapes = [(12, 40)] * 4 + [(40, 12)] * 3 + [(24, 24)]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return [p.detach().clone() for p in params], [e.name for e in prof.profiler.function_events]


@pytest.mark.usefixtures("one_thread")
def test_batched_step_on_cpu_is_the_one_at_a_time_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch changes the kernels (``bmm`` against ``mm``), not the maths. Different kernels may
    round differently (CONTRIBUTING.md, "Bits and tolerances"), so the bound is arithmetic: per step,
    at most 4 bfloat16 roundings (2^-7 each at the update's unit scale) of the update lr * scale * O,
    with scale = sqrt(max(1, rows / cols)) <= sqrt(40 / 12). A matrix taken for another would move a
    parameter by up to about lr * scale (0.037), 16x the bound (0.0023)."""
    batched, batched_ops = _step(monkeypatch, "always")
    single, single_ops = _step(monkeypatch, "never")
    assert "aten::bmm" in batched_ops and "aten::bmm" not in single_ops  # the switch took effect
    bound = 2 * 0.02 * (40 / 12) ** 0.5 * 4 * 2**-7
    for a, b in zip(batched, single, strict=True):
        assert (a - b).abs().max() <= bound


def test_collectives_per_step_do_not_grow_with_depth() -> None:
    counts: Callable[..., dict[int, dict]] = bench_host.rank_counts
    per_rank = run_ranks(counts, 2, [1, 2], "always", timeout=180)
    for rank in per_rank:
        assert rank[1]["ops"] < rank[2]["ops"]  # the count sees the second layer's work
        assert rank[1]["collectives"] == rank[2]["collectives"] > 0
        assert rank[1]["collective_names"] == rank[2]["collective_names"]


# Muon options of the momentum-dtype counts: one exchange round, and Newton-Schulz kept cheap (its
# ops per batch do not depend on the number of iterations or on the depth).
_ONE_ROUND: dict[str, Any] = {"max_round_bytes": None, "ns_steps": 1, "ns_dtype": torch.float32}
_MOMENTUM = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.int8}


def _ops_per_layer(width: int, layers: int) -> dict[str, float]:
    """Top-level ops added per layer (2 ranks, batched path, the busiest rank) per momentum dtype."""
    added = {}
    for name, dtype in _MOMENTUM.items():
        options = _ONE_ROUND | {"momentum_dtype": dtype}
        counts = bench_host.rank_counts
        per_rank = run_apart(counts, 2, [layers, 2 * layers], "always", 1, width, options, timeout=900)
        ops = [max(rank[n]["ops"] for rank in per_rank) for n in (layers, 2 * layers)]
        added[name] = (ops[1] - ops[0]) / layers
    return added


@background.job("ops_per_layer_at_width_16")
def _ops_at_width_16(folder: Path) -> dict[str, float]:
    return _ops_per_layer(16, 4)


ops_per_layer_at_width_16 = background.reader("ops_per_layer_at_width_16")


def test_momentum_dtypes_add_no_host_ops_per_layer(ops_per_layer_at_width_16: dict[str, float]) -> None:
    """bf16 momentum asked torch for its working dtype once per matrix (``aten::promote_types``, a
    host op): 7 ops per layer more than float32 at width 16."""
    added = ops_per_layer_at_width_16
    assert added == {"float32": 0.0, "bfloat16": 0.0, "int8": 0.0}, added


@background.job("ops_per_layer_at_width_512")
def _ops_at_width_512(folder: Path) -> dict[str, float]:
    """Its three counts, each on a pool of its own beside the session's tests (``run_apart``)."""
    return _ops_per_layer(512, 4)


ops_per_layer_at_width_512 = background.reader("ops_per_layer_at_width_512")


@pytest.mark.slow
def test_momentum_dtypes_add_no_more_host_ops_per_layer_than_float32_at_width_512(
    ops_per_layer_at_width_512: dict[str, float],
) -> None:
    """At width 512 a rank's gate matrices of 8 layers fill 6.3M elements. Once, int8 momentum's
    fixed chunks of 2**22 added 16.5 ops per layer (measured at 8 and 16 layers), and bf16's pass over
    CPU pieces more ops per piece than float32's (on CPU, float32's pieces grow with the elements
    too; CUDA buckets do not). Chunks now grow with the device's memory and int8 no longer issues ops
    per chunk: a fixed 2**22 chunk put back passes at 4 and 8 layers and at 8 and 16 alike (stop 54),
    so this holds each dtype's added ops per layer to float32's, at half the old CPU."""
    added = ops_per_layer_at_width_512
    assert added["int8"] <= added["float32"] and added["bfloat16"] <= added["float32"], added
