"""Bad input on some or all ranks: every rank must raise the same clear error, and none may hang."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from muon_dtensor import Muon


def _mesh(shape: tuple[int, ...] | None = None):
    return init_device_mesh("cpu", shape or (dist.get_world_size(),))


def _param(shape, mesh, placements=None) -> nn.Parameter:
    torch.manual_seed(0)
    return nn.Parameter(distribute_tensor(torch.randn(shape), mesh, list(placements or [Shard(0)])))


def _grad_like(p: nn.Parameter) -> DTensor:
    """A gradient built from the local shard alone: no collective, so one rank may make it alone."""
    local = torch.ones(p.to_local().shape)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
    )


def _two(mesh) -> list[tuple[str, nn.Parameter]]:
    return [("blocks.0.w", _param((6, 4), mesh)), ("blocks.1.w", _param((3, 5), mesh))]


def grad_on_some_ranks() -> None:
    params = _two(_mesh())
    opt = Muon(params)
    params[0][1].grad = _grad_like(params[0][1])
    if dist.get_rank() == 0:
        params[1][1].grad = _grad_like(params[1][1])
    opt.step()


def sparse_grad_on_one_rank() -> None:
    plain = nn.Parameter(torch.randn(4, 4))
    params = _two(_mesh())
    opt = Muon([{"params": params}, {"params": [("head.w", plain)], "algorithm": "adamw"}])
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
        params[0][1].grad = DTensor.from_local(local, params[0][1].device_mesh, [Partial()], run_check=False)
    opt.step()


def params_on_two_meshes() -> None:
    world = dist.get_world_size()
    a = _param((6, 4), _mesh((world,)))
    b = _param((6, 4), init_device_mesh("cpu", (1, world)), (Replicate(), Shard(0)))
    Muon([("a.w", a), ("b.w", b)])


def rank_outside_mesh() -> None:
    """A pipeline stage's parameter handed to a rank outside that stage: that rank raises at
    construction, naming it; the stage's own rank builds and steps without a collective to wait on."""
    stage0 = DeviceMesh("cpu", [0])
    p = _param((6, 4), stage0)
    opt = Muon([("stage0.w", p)], lr=0.1)
    p.grad = _grad_like(p)
    opt.step()


def non_2d_dtensor() -> None:
    Muon([("blocks.0.conv", _param((4, 3, 2), _mesh()))])


def complex_dtensor() -> None:
    p = nn.Parameter(distribute_tensor(torch.randn(4, 4, dtype=torch.complex64), _mesh(), [Shard(0)]))
    Muon([("rot.w", p)])


def partial_param() -> None:
    mesh = _mesh()
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()], run_check=False))
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


CASES: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        grad_on_some_ranks,
        sparse_grad_on_one_rank,
        mislaid_grad_on_one_rank,
        params_on_two_meshes,
        rank_outside_mesh,
        non_2d_dtensor,
        complex_dtensor,
        partial_param,
        negative_lr_at_step,
        unknown_preset,
    )
}


def run_case(name: str) -> tuple[str, str]:
    """Run one case; return (exception type, message), or ("none", "") if nothing was raised."""
    try:
        CASES[name]()
    except Exception as e:  # noqa: BLE001 - the test judges type and message
        return type(e).__name__, str(e)
    return "none", ""


def no_grad_anywhere_is_skipped() -> bool:
    """A parameter without a gradient on any rank is skipped on every rank, and the rest step."""
    params = _two(_mesh())
    opt = Muon(params, lr=0.1)
    before = [p.detach().full_tensor() for _, p in params]
    params[0][1].grad = _grad_like(params[0][1])
    opt.step()
    after = [p.detach().full_tensor() for _, p in params]
    return (not torch.equal(before[0], after[0])) and torch.equal(before[1], after[1])
