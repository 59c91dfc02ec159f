"""A model as a dict of named parameters, for tests that lay each parameter out by hand (MoE
stacks, int8 momentum): steps on the synthetic gradients of ``tests.helpers.stage_layouts.gradient``, the
full weights and state, and the parameters as a module for the checkpoint helpers."""

from __future__ import annotations

import torch
from torch import nn

from muon_dtensor import Muon
from tests.helpers.models import distribute_like, full
from tests.helpers.stage_layouts import gradient


def train(params: dict[str, nn.Parameter], opt: Muon, steps: range) -> None:
    """Steps on the same full gradient per name and step in every layout."""
    for step in steps:
        opt.zero_grad(set_to_none=True)
        for name, p in params.items():
            p.grad = distribute_like(p, gradient(name, tuple(p.shape), step))
        opt.step()


def snapshot(params: dict[str, nn.Parameter], opt: Muon) -> dict[str, torch.Tensor]:
    """Every full weight (by name) and state entry (``name:key``)."""
    out = {}
    for name, p in params.items():
        out[name] = full(p.detach()).clone()
        out.update({f"{name}:{k}": full(v).clone() for k, v in opt.state[p].items()})
    return out


def saved_and_final(
    params: dict[str, nn.Parameter], opt: Muon, split: int, total: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``snapshot`` after ``split`` steps (what a checkpoint there saves) and after ``total``."""
    train(params, opt, range(split))
    saved = snapshot(params, opt)
    train(params, opt, range(split, total))
    return saved, snapshot(params, opt)


class AsModule(nn.Module):
    """The parameters as a module, for the checkpoint helpers (FQNs = the parameters' names)."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        for name, p in params.items():
            self.register_parameter(name, p)
