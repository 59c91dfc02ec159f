"""``Muon.metrics()``: the last step's figures, flat, for a trainer's logger.

The update RMS is read back from the parameters themselves (their change, weight decay taken out),
in one process and summed over 2 FSDP ranks; the counts come from the plan; QK-Clip's largest
logit after clipping is at most the threshold.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, qk_clip_all_
from tests.harness.ranks import run_ranks
from tests.helpers.models import distribute_like, full

SHAPES = [(12, 8), (8, 20), (12, 8)]
LR, WD = 0.02, 0.1


def _params(gen: torch.Generator) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _measured_rms(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """The update's RMS from the parameters: before * (1 - lr wd) - after."""
    squares = sum(float((b * (1 - LR * WD) - a).double().square().sum()) for b, a in zip(before, after))
    return math.sqrt(squares / sum(b.numel() for b in before))


def test_one_process_figures() -> None:
    gen = torch.Generator().manual_seed(0)
    params = _params(gen)
    bias = nn.Parameter(torch.randn(4, generator=gen))
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = Muon(groups, lr=LR, weight_decay=WD)
    for p in [*params, bias]:
        p.grad = torch.randn(p.shape, generator=gen)
    before = [p.detach().clone() for p in params]
    opt.step()
    m = opt.metrics()
    assert math.isclose(
        m["muon/update_rms"], _measured_rms(before, [p.detach() for p in params]), rel_tol=1e-4
    )
    assert m["muon/update_rms"] > 0 and m["muon/update_elements"] == sum(p.numel() for p in params)
    assert (m["muon/matrices"], m["adamw/tensors"], m["muon/orthogonalized"]) == (3.0, 1.0, 3.0)
    assert m["muon/bytes_sent"] == m["muon/collectives"] == 0.0 and m["muon/ns_seconds"] > 0
    opt.step()  # the figures are the last step's, not the sum of two
    assert opt.metrics()["muon/orthogonalized"] == 3.0


def fsdp_figures() -> tuple[dict[str, float], float, dict[str, float]]:
    """Rank function: FSDP-like Shard(0) DTensors; this rank's figures and the measured full RMS."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in _params(gen)]
    # AdamW: a sharded bias and a replicated plain tensor, each one tensor of the job
    adamw = [nn.Parameter(distribute_tensor(torch.randn(4, generator=gen), mesh, [Shard(0)]))]
    adamw.append(nn.Parameter(torch.randn(3, generator=gen)))
    groups: list[dict[str, Any]] = [{"params": params}, {"params": adamw, "algorithm": "adamw"}]
    opt = Muon(groups, lr=LR, weight_decay=WD)
    for p in params:
        p.grad = distribute_like(p, torch.randn(p.shape, generator=gen))
    for p in adamw:
        p.grad = distribute_like(p, torch.ones(p.shape)) if isinstance(p, DTensor) else torch.ones(p.shape)
    before = [full(p.detach()).clone() for p in params]
    opt.step()
    mine, job = opt.metrics(), opt.metrics(reduce=True)
    return mine, _measured_rms(before, [full(p.detach()) for p in params]), job


def test_two_ranks_add_up_to_the_whole_update() -> None:
    results = run_ranks(fsdp_figures, 2, timeout=120)
    squares = sum(m["muon/update_rms"] ** 2 * m["muon/update_elements"] for m, _, _ in results)
    elements = sum(m["muon/update_elements"] for m, _, _ in results)
    assert elements == sum(math.prod(s) for s in SHAPES)
    assert math.isclose(math.sqrt(squares / elements), results[0][1], rel_tol=1e-4)
    assert sum(m["muon/orthogonalized"] for m, _, _ in results) == len(SHAPES)  # once in the world
    assert all(m["muon/collectives"] >= 2 and m["muon/bytes_sent"] > 0 for m, _, _ in results)


def test_reduce_gives_every_rank_the_jobs_figures() -> None:
    """``metrics(reduce=True)``: the update RMS of the whole model, not rank 0's pieces (a rank 0 log
    missed the rest), the counts summed; the same dict on every rank."""
    results = run_ranks(fsdp_figures, 2, timeout=120)
    (_, measured, job), (_, _, job_1) = results
    assert job == job_1
    assert math.isclose(job["muon/update_rms"], measured, rel_tol=1e-4)
    assert job["muon/update_elements"] == sum(math.prod(s) for s in SHAPES)
    assert job["muon/orthogonalized"] == len(SHAPES)
    assert job["adamw/tensors"] == 2.0  # counted once, not once per rank (it was 4.0)
    assert job["muon/bytes_sent"] == sum(m["muon/bytes_sent"] for m, _, _ in results)


def _stepped() -> Muon:
    """One process, one step on seeded gradients."""
    gen = torch.Generator().manual_seed(0)
    params = _params(gen)
    opt = Muon(params, lr=LR)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt


def test_every_key_says_whether_it_is_this_ranks_or_the_jobs() -> None:
    from muon_dtensor.optim.report import METRIC_SCOPES

    opt = _stepped()
    assert set(opt.metrics()) <= set(METRIC_SCOPES) and set(METRIC_SCOPES.values()) == {"rank", "job"}


def test_the_trainer_mixin_logs_the_jobs_figures_through_accelerates_wrapper() -> None:
    """Under the HF Trainer, ``trainer.optimizer`` is accelerate's wrapper, without ``metrics()``:
    ``LogMuonMetrics`` unwraps it and adds the figures to each training log."""
    from muon_dtensor.integrations.hf import LogMuonMetrics

    opt = _stepped()
    logged: list[dict[str, float]] = []

    class Wrapper:  # as accelerate's AcceleratedOptimizer holds the optimizer
        optimizer = opt

    class Base:
        def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            logged.append(dict(logs))

    class Trainer(LogMuonMetrics, Base):
        optimizer = Wrapper()

    Trainer().log({"loss": 1.0})
    Trainer().log({"eval_loss": 1.0})
    assert logged[0]["loss"] == 1.0 and logged[0]["muon/update_rms"] == opt.metrics()["muon/update_rms"]
    assert "muon/update_rms" not in logged[1]


def test_qk_clip_figures() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, 8, generator=gen), torch.randn(8, 8, generator=gen)
    logits = torch.tensor([120.0, 3.0, 50.0, 400.0])
    factors = qk_clip_all_([(q, k, logits)], head_dim=4, threshold=100.0)
    opt = Muon([nn.Parameter(torch.randn(4, 4))])
    m = opt.metrics(qk_clip=factors)
    assert m["qk_clip/max_logit"] == 400.0
    assert m["qk_clip/max_logit_after"] <= 100.0 * (1 + 1e-5)
