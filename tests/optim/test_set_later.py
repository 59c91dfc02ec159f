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


def _after_a_step(
    change: Callable[[Muon], object], ranks: tuple[int, ...] = (1,), lr: Any = 0.02
) -> Callable[[], None]:
    """``change`` on ``ranks`` after one step, when every group's settings are resolved and kept
    (``checks/settings_cache.py``): the digest must still see it."""

    def case() -> None:
        opt, params = _opt()
        opt.param_groups[0]["lr"] = lr
        for step in range(2):
            if step == 1 and dist.get_rank() in ranks:
                change(opt)
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()

    return case


def _put(group: int, key: str, value: Any) -> Callable[[Muon], object]:
    return lambda opt: opt.param_groups[group].__setitem__(key, value)


def _edit_coefficients(opt: Muon) -> None:
    opt.param_groups[0]["ns_coefficients"][1] = (2.0, -1.5, 0.5)  # the list in place


def _there_and_back(opt: Muon) -> None:
    opt.param_groups[0]["lr"] = 0.03
    opt.param_groups[0]["lr"] = 0.02


def _coefficients_list() -> Callable[[], None]:
    def case() -> None:
        opt, params = _opt()
        opt.param_groups[0]["ns_coefficients"] = [(3.4445, -4.775, 2.0315), (3.0, -3.2, 1.2)]
        for step in range(2):
            if step == 1 and dist.get_rank() == 1:
                _edit_coefficients(opt)
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()

    return case


def _tensor_lr() -> Callable[[], None]:
    def case() -> None:
        lr = torch.tensor(0.02)
        _after_a_step(lambda opt: lr.fill_(0.03), lr=lr)()

    return case


DISAGREE = "ranks disagree about the optimizer"
ADAMW_DTYPE = "is an AdamW group and sets 'momentum_dtype'"
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
    # after a step, with every group's settings kept: a change on one rank is still a disagreement
    "lr_after_a_step": (_after_a_step(_put(0, "lr", 0.03)), (DISAGREE, DISAGREE)),
    "tensor_lr_filled_on_one_rank": (_tensor_lr(), (DISAGREE, DISAGREE)),
    "coefficients_list_edited_on_one_rank": (_coefficients_list(), (DISAGREE, DISAGREE)),
    "momentum_dtype_name_after_a_step": (
        _after_a_step(_put(0, "momentum_dtype", "bfloat16")),
        (DISAGREE, DISAGREE),
    ),
    "adamw_momentum_dtype_everywhere": (
        _after_a_step(_put(1, "momentum_dtype", torch.bfloat16), ranks=(0, 1)),
        (ADAMW_DTYPE, ADAMW_DTYPE),
    ),
    "changed_and_back_on_one_rank": (_after_a_step(_there_and_back), ("none", "none")),
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
        if expected == "none":  # no change left: every rank steps
            assert message == "none", f"rank {rank}: {message}"
            continue
        assert message != "none", f"rank {rank} did not raise"
        assert expected in message, f"rank {rank}: {message}"
