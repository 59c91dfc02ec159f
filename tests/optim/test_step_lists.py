"""What a steady step keeps between steps about its parameters' local tensors, and what it checks
each time: which parameters assemble their update from several matrices (``functional._assembled``,
kept per plan) must follow the parameters it is asked about, never a stale entry; the gradients
read in bulk (``optimizer._local_grads``) must be each parameter's own local gradient."""

from __future__ import annotations

import torch
from torch import nn

from muon_dtensor import Muon
from muon_dtensor.optim.functional import _assembled
from muon_dtensor.optim.optimizer import _local_grads


def _stepped() -> tuple[Muon, list[nn.Parameter]]:
    torch.manual_seed(0)
    params = [
        nn.Parameter(torch.randn(4, 4)),
        nn.Parameter(torch.randn(3, 4, 4)),
        nn.Parameter(torch.randn(5, 3)),
    ]
    opt = Muon([{"params": params, "experts": True}], lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt, params


def test_assembled_positions_follow_the_parameters_asked_about() -> None:
    opt, params = _stepped()
    domains = opt._plans.domains(0, opt.param_groups[0], [0, 1, 2])
    assert _assembled(params, domains) == (1,)  # the 3-D parameter: three expert matrices
    assert _assembled(params, domains) == (1,)  # kept: the same answer
    reshaped = [params[0].detach().reshape(2, 8), params[1], params[2]]
    assert _assembled(reshaped, domains) == (0, 1)  # other local shapes: found again, not the kept one
    assert _assembled(params, []) == (0, 1, 2)  # no views: every update assembled


def test_local_grads_are_each_parameters_own() -> None:
    _, params = _stepped()
    grads = _local_grads(list[torch.Tensor](params), list[torch.Tensor](params))
    assert all(g is p.grad for g, p in zip(grads, params))
