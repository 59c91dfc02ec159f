"""The cost model's host term counts what the code issues.

``planning/host_ops.step_ops`` reads a rank's routes and counts the eager ops the step issues for
each event; here it is held to the profiler's count of top-level ``aten::`` ops for
``benchmarks/bench_host.py``'s Llama-shaped model, on every rank, at 2 and 4 ranks, on the CPU path
and with the CUDA path's batching (``MUON_DTENSOR_NS_BATCH``): within 10%.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from benchmarks import bench_host
from muon_dtensor import Muon, split_params
from muon_dtensor.planning.host_ops import StepShape, step_ops
from tests.harness import background


def model_count(opt: Muon, batched: bool) -> dict[str, int]:
    """The model's count for ``opt``'s next step on this rank, from the plans it built."""
    adamw = sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "adamw")
    parts = {"checks": 0, "pre": 0, "exchange": 0, "post": 0, "adamw": 0}
    first = True
    for index, group in enumerate(opt.param_groups):
        if group["algorithm"] != "muon":
            continue
        todo = list(range(len(group["params"])))
        domains = opt._plans.entries[index].sharding.domains(todo, group["mode"], group["max_round_bytes"])
        for domain in domains:
            shape = StepShape(
                muon_params=len(todo) if first else 0,
                adamw_params=adamw if first else 0,
                batched=batched,
                ns_steps=group["ns_steps"],
            )
            rank = dist.get_rank(domain.group) if domain.group is not None else 0
            for key, value in step_ops(domain.plan, rank, shape).items():
                parts[key] += value if first or key in ("exchange", "post") else 0
            first = False
    return parts


def counts(layers: int, path: str) -> dict[str, Any]:
    """Rank function: the profiler's count of a steady step and the model's."""
    model = bench_host.sharded_model(layers)
    opt = Muon(split_params(model, adamw_options=dict(bench_host.ADAMW_OPTIONS)), lr=0.02)
    with bench_host.ns_batch(path):
        for _ in range(2):
            opt.step()
    measured = bench_host.count_step(opt, path)["ops"]
    return {"measured": measured, "model": model_count(opt, path == "always")}


def counts_by_depth(path: str) -> dict[int, dict[str, Any]]:
    """Rank function: ``counts`` at 8 and at 16 layers."""
    return {layers: counts(layers, path) for layers in (8, 16)}


# Each case a background job on a pool of its own (tests/harness/background.py, ``apart``).
host_counts_never_on_2 = background.apart("host_counts_never_on_2", counts_by_depth, 2, "never", timeout=600)
host_counts_always_on_2 = background.apart(
    "host_counts_always_on_2", counts_by_depth, 2, "always", timeout=600
)
host_counts_never_on_4 = background.apart("host_counts_never_on_4", counts_by_depth, 4, "never", timeout=600)
host_counts_always_on_4 = background.apart(
    "host_counts_always_on_4", counts_by_depth, 4, "always", timeout=600
)


def test_host_term_equals_the_profilers_count(
    host_counts_never_on_2: list[Any], host_counts_always_on_2: list[Any]
) -> None:
    """On the CPU path (``never``) and with the CUDA path's batching (``always``), 2 ranks."""
    _check_counts(host_counts_never_on_2)
    _check_counts(host_counts_always_on_2)


@pytest.mark.slow
def test_host_term_equals_the_profilers_count_on_4_ranks(
    host_counts_never_on_4: list[Any], host_counts_always_on_4: list[Any]
) -> None:
    _check_counts(host_counts_never_on_4)
    _check_counts(host_counts_always_on_4)


def _check_counts(per_rank: list[dict[int, dict[str, Any]]]) -> None:
    for rank, by_depth in enumerate(per_rank):
        for layers, r in by_depth.items():
            total = sum(r["model"].values())
            assert abs(total - r["measured"]) <= 0.1 * r["measured"], f"{layers} layers, rank {rank}: {r}"
