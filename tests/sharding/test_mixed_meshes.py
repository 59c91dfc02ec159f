"""Several meshes in one param group: a dp x tp model whose first matrices are tensor parallel and
whose last ones are only fully_shard-ed over dp, in the one Muon group ``split_params`` builds.

Regression: such a group raised "one param group holds parameters on different meshes", while
torch.optim.Muon runs it; real models mix meshes (MoE routers, adapters, layers left out of the TP
plan). Each step must equal the one-process step bitwise, with uneven and empty shards, on a 2x2
mesh and on a 3-D mesh.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from muon_dtensor import Muon, split_params
from muon_dtensor.optim.group_sharding import layout_of
from tests.harness.ranks import run_ranks
from tests.helpers.models import MLP, dt

MESHES = [((2, 2), ("dp", "tp")), ((1, 2, 2), ("replicate", "shard", "tp"))]


def _shard(model: MLP, mesh: DeviceMesh, dp: tuple[str, ...]) -> MLP:
    """w1, w2 tensor parallel; w3 and w4 on the dp mesh alone."""
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    dp_mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
    for layer in (model.w3, model.w4):
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _piece(full: torch.Tensor, p: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's piece of a full tensor, cut by the blocks the optimizer uses."""
    if not isinstance(p, DTensor):
        return full
    layout = layout_of(p, name)
    for d, intervals in enumerate(layout.blocks[layout.rank]):
        full = full.index_select(d, torch.cat([torch.arange(a, b) for a, b in intervals]))
    return full


def mixed_mesh_exactness(mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int = 3) -> dict:
    torch.manual_seed(0)
    ref = MLP((16, 37, 20, 1, 16))  # w1 uneven over tp; w3 one row: an empty shard over dp
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = _shard(copy.deepcopy(ref), mesh, tuple(n for n in names if n != "tp"))
    groups = split_params(model)
    opt, ref_opt = Muon(groups, lr=0.02), Muon(split_params(ref), lr=0.02)
    named = dict(model.named_parameters())
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 + step)
        for (n, p), q in zip(named.items(), ref.parameters()):
            g = torch.randn(q.shape, generator=gen)
            q.grad = g.clone()
            local = _piece(g, p, n).contiguous()
            p.grad = DTensor.from_local(
                local, dt(p).device_mesh, dt(p).placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        opt.step()
        ref_opt.step()
    bad = []
    for (n, p), q in zip(named.items(), ref.parameters()):
        if not torch.equal(dt(p).to_local(), _piece(q.detach(), p, n)):
            bad.append(n)
        buf, ref_buf = opt.state[p].get("momentum_buffer"), ref_opt.state[q].get("momentum_buffer")
        if buf is not None and not torch.equal(buf.to_local(), _piece(ref_buf, p, n)):
            bad.append(f"{n}:momentum_buffer")
    meshes = {tuple(p.device_mesh.mesh.shape) for p in opt.param_groups[0]["params"]}
    return {"bad": bad, "meshes_in_muon_group": len(meshes)}


@pytest.mark.parametrize(("mesh_shape", "names"), MESHES, ids=[str(m) for m, _ in MESHES])
def test_one_group_on_several_meshes_equals_single_process(mesh_shape: tuple, names: tuple) -> None:
    for rank, result in enumerate(run_ranks(mixed_mesh_exactness, 4, mesh_shape, names, timeout=180)):
        assert result["meshes_in_muon_group"] == 2, result
        assert result["bad"] == [], f"rank {rank}: {result['bad']}"
