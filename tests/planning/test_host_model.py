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
from tests.harness.ranks import run_ranks


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


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", ["never", "always"])
def test_host_term_equals_the_profilers_count(world_size: int, path: str) -> None:
    for layers in (8, 16):
        results = run_ranks(counts, world_size, layers, path, timeout=300)
        for rank, r in enumerate(results):
            total = sum(r["model"].values())
            assert abs(total - r["measured"]) <= 0.1 * r["measured"], f"{layers} layers, rank {rank}: {r}"
