"""Every bad input raises on every rank, names the parameter, and finishes within a timeout.

All cases run one after another in one 2-rank run (a module fixture): each rank catches each case's
error and reports (type, message), so a case that raised on one rank only would leave the other rank
waiting in a collective and fail the run at its deadline. Should the shared run fail, each test runs
its own case alone, so the failure is reported against the case that caused it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

from muon_dtensor import Muon
from tests.harness.ranks import RankError, run_ranks
from tests.helpers.models import dt, full

CASES = [
    ("grad_on_some_ranks", "RuntimeError", r"'blocks.1.w' has a gradient on 1 of 2 rank"),
    ("grads_on_other_params", "RuntimeError", r"'blocks.0.w' has a gradient on 1 of 2 rank"),
    ("sparse_grad_on_one_rank", "RuntimeError", r"sparse gradients: 'head.w' has one on 1 of 2"),
    ("mislaid_grad_on_one_rank", "ValueError", r"gradient of 'blocks.0.w' is not laid out like"),
    ("non_2d_dtensor", "ValueError", r"only supports 2D parameters.*'blocks.0.conv'.*adamw"),
    ("complex_dtensor", "RuntimeError", r"does not support complex parameters: 'rot.w'"),
    ("partial_param", "ValueError", r"'odd.w' has placements \(Partial"),
    ("negative_lr_at_step", "ValueError", r"Learning rate should be >= 0 but is: -0.5"),
    ("unknown_preset", "ValueError", r"Unknown ns_coefficients preset 'kellr'"),
]
Outcomes = dict[str, list[Any]] | None  # case -> each rank's outcome, None: the shared run failed
TIMEOUT = 60  # seconds for one case alone, and for the shared run (all cases take ~2 s together)


@pytest.fixture(scope="module")
def outcomes() -> Outcomes:
    """Every case's per-rank outcome from one shared run, or None if that run failed."""
    names = [*(c[0] for c in CASES), "rank_outside_mesh", "no_grad_anywhere_is_skipped"]
    try:
        per_rank = run_ranks(run_cases, 2, names, timeout=TIMEOUT)
    except RankError:
        return None
    return {name: [r[name] for r in per_rank] for name in names}


def _outcome(outcomes: Outcomes, name: str) -> list[Any]:
    if outcomes is not None:
        return outcomes[name]
    return [r[name] for r in run_ranks(run_cases, 2, [name], timeout=TIMEOUT)]


@pytest.mark.parametrize(("case", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_on_every_rank(outcomes: Outcomes, case: str, error: str, pattern: str) -> None:
    for rank, (kind, message) in enumerate(_outcome(outcomes, case)):
        assert kind == error, f"rank {rank} raised {kind}: {message}"
        assert re.search(pattern, message), f"rank {rank}: {message}"


def test_rank_outside_a_parameters_mesh_raises_on_every_rank(outcomes: Outcomes) -> None:
    """With a step_group, construction agrees over the default group (issue 41): the stage's own rank
    raises the outside rank's error too, instead of stepping on while that rank failed."""
    outcome = _outcome(outcomes, "rank_outside_mesh")
    assert outcome[0] == outcome[1], outcome
    kind, message = outcome[1]
    assert kind == "ValueError" and "'stage0.w'" in message and "rank 1 is not part of its mesh" in message


def test_parameter_without_gradient_anywhere_is_skipped(outcomes: Outcomes) -> None:
    assert _outcome(outcomes, "no_grad_anywhere_is_skipped") == [("none", True), ("none", True)]


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _mesh(shape: tuple[int, ...] | None = None) -> DeviceMesh:
    return init_device_mesh("cpu", shape or (dist.get_world_size(),))


def _param(shape: tuple[int, ...], mesh: DeviceMesh, placements: list | None = None) -> nn.Parameter:
    torch.manual_seed(0)
    return nn.Parameter(distribute_tensor(torch.randn(shape), mesh, list(placements or [Shard(0)])))


def _grad_like(p: nn.Parameter) -> DTensor:
    """A gradient built from the local shard alone: no collective, so one rank may make it alone."""
    local = torch.ones(dt(p).to_local().shape)
    return DTensor.from_local(
        local, dt(p).device_mesh, dt(p).placements, shape=p.shape, stride=p.stride(), run_check=False
    )


def _two(mesh: DeviceMesh) -> list[tuple[str, nn.Parameter]]:
    return [("blocks.0.w", _param((6, 4), mesh)), ("blocks.1.w", _param((3, 5), mesh))]


def grad_on_some_ranks() -> None:
    params = _two(_mesh())
    opt = Muon(params)
    params[0][1].grad = _grad_like(params[0][1])
    if dist.get_rank() == 0:
        params[1][1].grad = _grad_like(params[1][1])
    opt.step()


def grads_on_other_params() -> None:
    """As many gradients on every rank, on different parameters: the count alone cannot tell (a
    steady step sums a digest of which parameters have one)."""
    params = _two(_mesh())
    opt = Muon(params)
    mine = params[dist.get_rank() % 2][1]
    mine.grad = _grad_like(mine)
    opt.step()


def sparse_grad_on_one_rank() -> None:
    plain = nn.Parameter(torch.randn(4, 4))
    params = _two(_mesh())
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [("head.w", plain)], "algorithm": "adamw"}]
    opt = Muon(groups)
    for _, p in params:
        p.grad = _grad_like(p)
    plain.grad = torch.ones(4, 4).to_sparse() if dist.get_rank() == 1 else torch.ones(4, 4)
    opt.step()


def mislaid_grad_on_one_rank() -> None:
    params = _two(_mesh())
    opt = Muon(params)
    for _, p in params:
        p.grad = _grad_like(p)
    if dist.get_rank() == 1:
        # A Partial gradient nobody reduced (built locally: DTensor metadata differs per rank).
        local = torch.ones(6, 4)
        params[0][1].grad = DTensor.from_local(
            local, dt(params[0][1]).device_mesh, [Partial()], run_check=False
        )
    opt.step()


def rank_outside_mesh() -> None:
    """A pipeline stage's parameter handed to a rank outside that stage: that rank fails at
    construction, naming it, and (with a step_group) every rank raises that error there."""
    stage0 = DeviceMesh("cpu", [0])
    p = _param((6, 4), stage0)
    opt = Muon([("stage0.w", p)], lr=0.1, step_group=stage0)
    p.grad = _grad_like(p)
    opt.step()


def non_2d_dtensor() -> None:
    Muon([("blocks.0.conv", _param((4, 3, 2), _mesh()))])


def complex_dtensor() -> None:
    p = nn.Parameter(distribute_tensor(torch.randn(4, 4, dtype=torch.complex64), _mesh(), [Shard(0)]))
    Muon([("rot.w", p)])


def partial_param() -> None:
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 4), _mesh(), [Partial()], run_check=False))
    Muon([("odd.w", p)])


def negative_lr_at_step() -> None:
    params = _two(_mesh())
    opt = Muon(params)
    for _, p in params:
        p.grad = _grad_like(p)
    opt.param_groups[0]["lr"] = -0.5
    opt.step()


def unknown_preset() -> None:
    Muon(_two(_mesh()), ns_coefficients="kellr")


def no_grad_anywhere_is_skipped() -> bool:
    """A parameter without a gradient on any rank is skipped on every rank, and the rest step."""
    params = _two(_mesh())
    opt = Muon(params, lr=0.1)
    before = [full(p.detach()) for _, p in params]
    params[0][1].grad = _grad_like(params[0][1])
    opt.step()
    after = [full(p.detach()) for _, p in params]
    return (not torch.equal(before[0], after[0])) and torch.equal(before[1], after[1])


RANK_CASES: dict[str, Callable[[], Any]] = {
    f.__name__: f
    for f in (
        grad_on_some_ranks,
        grads_on_other_params,
        sparse_grad_on_one_rank,
        mislaid_grad_on_one_rank,
        rank_outside_mesh,
        non_2d_dtensor,
        complex_dtensor,
        partial_param,
        negative_lr_at_step,
        unknown_preset,
        no_grad_anywhere_is_skipped,
    )
}


def run_cases(names: list[str]) -> dict[str, tuple[str, Any]]:
    """Run the cases in order; each gives (exception type, message), or ("none", its return value)."""
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        torch.manual_seed(0)
        try:
            value = RANK_CASES[name]()
        except Exception as e:  # noqa: BLE001 - the test judges type and message
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = ("none", "" if value is None else value)
        _in_step(name)
    return out


def _in_step(name: str) -> None:
    """Every rank finished the same case: otherwise the next case's collectives would pair with the
    wrong ones, and the run fails here so that each case runs alone."""
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, name)
    if seen != [name] * len(seen):
        raise RuntimeError(f"ranks out of step after {name!r}: {seen}")
