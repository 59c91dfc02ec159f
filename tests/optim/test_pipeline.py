"""Pipeline parallelism: 2 stages x 2 FSDP2 shards on a ("pp", "dp") mesh of 4 gloo ranks, one Muon
per stage, forward and backward through ``torch.distributed.pipelining`` (GPipe, 2 micro-batches).

Both dp ranks of a stage see the whole batch, so FSDP's mean of their gradients is exact and the
real pipelined gradients equal one process's bit for bit; so does every step (parameters, momentum
buffers, AdamW moments). Each stage's matrices are orthogonalized by that stage's ranks only, a
stage steps while the other has not, and owners over a stage's HSDP mesh (``owners="mesh"``, on one
stage or both) leave the other stage and later process groups alone.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import distribute_like, full, random_grads
from tests.helpers.pipeline import Pipeline, differences, muon, part, reference_backward, snapshot, stack

TIMEOUT = 90.0  # one 4-rank call on 2 busy cores takes about 10 s
MATRICES_PER_STAGE = 2  # layers.0/1.weight on stage 0, layers.2/3.weight on stage 1


def test_pipeline_step_equals_single_process() -> None:
    results = run_ranks(pipeline_exactness, 4, 3, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["stage"] == rank // 2
        assert r["grads"] == [] and r["bad"] == [], f"rank {rank}: {r}"
        assert r["compared"] == (16 if rank < 2 else 24)  # every parameter and state entry of the part
    for stage in (0, 1):  # each stage's matrices, once per step, by the stage's own two ranks
        assert results[2 * stage]["orthogonalized"] + results[2 * stage + 1]["orthogonalized"] == 3 * 2


def test_a_stage_steps_while_the_other_waits() -> None:
    """Stage 1 blocks in a receive until stage 0 has taken two optimizer steps: a step of stage 0
    that waited on stage 1 would hang (and fail on the timeout)."""
    results = run_ranks(stage_zero_first, 4, timeout=TIMEOUT)
    assert [r["order"] for r in results] == [["step", "step", "send"]] * 2 + [["recv", "step", "step"]] * 2
    assert all(r["bad"] == [] for r in results), results


@pytest.mark.parametrize("owners", ["mesh", "mesh on stage 0"])
def test_owners_over_a_stage_mesh(owners: str) -> None:
    results = run_ranks(stage_owners, 4, owners, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["bad"] == [] and r["everyone"] == 4, (rank, r)
    over_mesh = [owners == "mesh" or rank < 2 for rank in range(4)]
    assert [r["across"] for r in results] == over_mesh
    for stage in (0, 1):  # two steps; over the mesh each matrix once, per replica once in each
        done = results[2 * stage]["orthogonalized"] + results[2 * stage + 1]["orthogonalized"]
        assert done == 2 * MATRICES_PER_STAGE * (1 if over_mesh[2 * stage] else 2)


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def pipeline_exactness(steps: int) -> dict[str, Any]:
    """Pipelined steps against one process doing the same micro-batches on the full model."""
    pipe, ref = Pipeline(), stack()
    ref_opt = muon(ref)
    grads = []
    for step in range(steps):
        pipe.opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        pipe.backward(step)
        reference_backward(ref, step)
        refs = dict(ref.named_parameters())
        grads += [
            f"{step}:{n}"
            for n, p in pipe.model.named_parameters()
            if not torch.equal(full(cast(torch.Tensor, p.grad)), cast(torch.Tensor, refs[n].grad))
        ]
        pipe.opt.step()
        ref_opt.step()
    mine = snapshot(pipe.model, pipe.opt)
    return {
        "stage": pipe.stage,
        "grads": grads,
        "bad": differences(mine, snapshot(ref, ref_opt)),
        "compared": len(mine),
        "orthogonalized": pipe.opt.comm_stats.orthogonalized,
    }


def _synthetic_steps(
    model: torch.nn.Module, opt: Muon, ref: torch.nn.Module, ref_opt: Muon, seed: int
) -> None:
    """One step of both with the same seeded full gradients."""
    shapes = [q.shape for q in ref.parameters()]
    for p, q, g in zip(model.parameters(), ref.parameters(), random_grads(shapes, seed), strict=True):
        q.grad, p.grad = g.clone(), distribute_like(p, g.clone())
    opt.step()
    ref_opt.step()


def stage_zero_first() -> dict[str, Any]:
    """Each stage's optimizer steps with its own ranks only (``step_group``: the stage's mesh)."""
    pipe = Pipeline()
    pipe.opt = Muon(split_params(pipe.model), lr=0.02, step_group=pipe.mesh["dp"])
    ref = part(stack(), pipe.stage)
    ref_opt, order = muon(ref), []
    token, peer = torch.zeros(1), (dist.get_rank() + 2) % 4
    if pipe.stage == 1:
        dist.recv(token, src=peer)
        order.append("recv")
    for step in range(2):
        _synthetic_steps(pipe.model, pipe.opt, ref, ref_opt, 10 + step)
        order.append("step")
    if pipe.stage == 0:
        dist.send(token, dst=peer)
        order.append("send")
    return {"order": order, "bad": differences(snapshot(pipe.model, pipe.opt), snapshot(ref, ref_opt))}


def stage_owners(owners: str) -> dict[str, Any]:
    """Each stage HSDP on its 2 ranks ("rep" 2 x "shard" 1 of a (2, 2, 1) mesh); after two steps,
    a group of every rank must still form (the stages created their exchange groups alone)."""
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))
    stage = mesh.get_local_rank("pp")
    model, ref = part(stack(), stage), part(stack(), stage)
    for module in [*model.layers.values(), model]:
        fully_shard(module, mesh=mesh["rep", "shard"])
    chosen: Literal["mesh", "replica"] = "mesh" if owners == "mesh" or stage == 0 else "replica"
    opt, ref_opt = Muon(split_params(model), lr=0.02, owners=chosen), muon(ref)
    for step in range(2):
        _synthetic_steps(model, opt, ref, ref_opt, 20 + step)
    everyone = torch.ones(1)
    dist.all_reduce(everyone, group=dist.new_group(list(range(dist.get_world_size()))))
    return {
        "bad": differences(snapshot(model, opt), snapshot(ref, ref_opt)),
        "across": bool(opt._plans.entries[0].sharding.across),
        "orthogonalized": opt.comm_stats.orthogonalized,
        "everyone": int(everyone),
    }
