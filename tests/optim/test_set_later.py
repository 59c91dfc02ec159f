"""A value set on one rank after construction raises on every rank, never hangs.

Regression: ``step()`` ran the local checks of hyperparameters before the agreement, so a bad value
set on one rank alone (lr NaN or -1, ns_steps 10**6, momentum -1, AdamW betas (2, 0), mode 'x')
raised there while the other rank waited in the agreement's all-reduce until the test's deadline
(6 of 6 cases hung). Now the local checks' failure travels in the same sum as the agreement's
digest, and every rank raises. All cases run in one pooled 2-rank run; each returns what its rank
raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_dtensor import Muon
from tests.harness.ranks import run_ranks


def _opt() -> tuple[Muon, list[nn.Parameter]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    muon = [
        nn.Parameter(distribute_tensor(torch.randn(6, 4, generator=gen), mesh, [Shard(0)])) for _ in range(2)
    ]
    adamw = nn.Parameter(distribute_tensor(torch.randn(6, generator=gen), mesh, [Shard(0)]))
    local = nn.Parameter(torch.randn(3, generator=gen))  # plain AdamW: stepped locally
    groups: list[dict[str, Any]] = [
        {"params": muon},
        {"params": [adamw], "algorithm": "adamw"},
        {"params": [local], "algorithm": "adamw"},
    ]
    return Muon(groups, lr=0.02), [*muon, adamw, local]


def _set(group: int, key: str, value: Any, ranks: tuple[int, ...] = (1,)) -> Callable[[], None]:
    def case() -> None:
        opt, params = _opt()
        if dist.get_rank() in ranks:
            opt.param_groups[group][key] = value
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    return case


DISAGREE = "ranks disagree about the optimizer"
CASES: dict[str, tuple[Callable[[], None], tuple[str, str]]] = {
    # one rank alone: the digests differ, every rank names the field
    "lr_nan": (_set(0, "lr", math.nan), (DISAGREE, DISAGREE)),
    "lr_negative": (_set(0, "lr", -1.0), (DISAGREE, DISAGREE)),
    "ns_steps_huge": (_set(0, "ns_steps", 10**6), (DISAGREE, DISAGREE)),
    "momentum_negative": (_set(0, "momentum", -1.0), (DISAGREE, DISAGREE)),
    "adamw_betas": (_set(1, "betas", (2.0, 0.0)), (DISAGREE, DISAGREE)),
    "mode_x": (_set(0, "mode", "x"), (DISAGREE, DISAGREE)),
    # a plain-tensor AdamW group is not compared (it may differ), but its check fails on rank 1
    "local_adamw_betas": (_set(2, "betas", (2.0, 0.0)), ("failed a check on 1 other rank", "beta")),
    # the same bad value everywhere: the local check's own message on every rank
    "lr_negative_everywhere": (_set(0, "lr", -1.0, ranks=(0, 1)), ("Learning rate", "Learning rate")),
    "mode_x_everywhere": (_set(0, "mode", "x", ranks=(0, 1)), ("mode should be", "mode should be")),
}


def run_cases() -> dict[str, str]:
    out = {}
    for name, (case, _) in CASES.items():
        try:
            case()
            out[name] = "none"
        except Exception as e:  # noqa: BLE001 - every case reports what it raised
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, str]]:
    return run_ranks(run_cases, 2, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_value_set_on_one_rank_raises_on_every_rank(case: str, outcomes: list[dict[str, str]]) -> None:
    for rank, expected in enumerate(CASES[case][1]):
        message = outcomes[rank][case]
        assert message != "none", f"rank {rank} did not raise"
        assert expected in message, f"rank {rank}: {message}"
