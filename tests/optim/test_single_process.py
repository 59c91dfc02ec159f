"""One process, plain tensors: the torch.optim.Muon / AdamW contract and the optimizer's plumbing."""

from __future__ import annotations

import re
import warnings
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.testing._internal.common_optimizers import optim_error_inputs_func_muon

from muon_dtensor import Muon, split_params

LR = 0.02


def _pair(shapes: list[tuple[int, ...]], seed: int = 0) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    ours = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def _set_grads(a: list[nn.Parameter], b: list[nn.Parameter], gen: torch.Generator) -> None:
    for p, q in zip(a, b):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_tracks_torch_optim_muon_over_10_steps(adjust_lr_fn: str | None, nesterov: bool) -> None:
    """Measured (torch 2.13 CPU): the largest parameter difference after 10 steps at lr 0.02 is
    about 1.2e-4, i.e. a few bfloat16 roundings of the update (lr * 2^-8 = 7.8e-5 each); momentum
    agrees to float32 rounding. The difference comes from our single-rounding elementwise ops (see
    muon_dtensor/update.py) flipping the last bit of a float32 value before the bfloat16 cast."""
    ours, theirs = _pair([(32, 48), (64, 16), (40, 40)])
    kwargs: dict[str, Any] = dict(lr=LR, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    a, b = Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _set_grads(ours, theirs, gen)
        a.step()
        b.step()
    scale = 0.2 * 48**0.5 if adjust_lr_fn == "match_rms_adamw" else 2.0
    for p, q in zip(ours, theirs):
        assert (p - q).abs().max() <= 10 * LR * scale * 2**-8
        ma, mb = a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]
        torch.testing.assert_close(ma, mb, rtol=1e-5, atol=1e-6)


def test_tracks_torch_optim_adamw() -> None:
    ours, theirs = _pair([(10, 8), (7,)])
    a = Muon([{"params": ours, "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.1}])
    b = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        _set_grads(ours, theirs, gen)
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(a.state[p][key], b.state[q][key], rtol=1e-5, atol=1e-7)


def test_adamw_group_defaults_are_torch_adamw_defaults() -> None:
    opt = Muon([{"params": [nn.Parameter(torch.randn(3))], "algorithm": "adamw"}], lr=5e-3)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        5e-3,
        (0.9, 0.999),
        1e-8,
        1e-2,
    )


def test_raises_what_torch_optim_muon_raises() -> None:
    """torch's own Muon error cases (torch.testing._internal.common_optimizers), same type and text."""
    cases = optim_error_inputs_func_muon("cpu", torch.float32)
    assert len(cases) >= 8
    for case in cases:
        inp = case.optimizer_error_input
        params = inp.params if inp.params is not None else [nn.Parameter(torch.randn(2, 3))]
        if case.error_type is UserWarning:
            with pytest.warns(UserWarning, match=case.error_regex):
                Muon(params, **inp.kwargs)
            continue
        with pytest.raises(case.error_type, match=case.error_regex):
            Muon(params, **inp.kwargs).step()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
        ({"momentum": -0.5}, "momentum should be >= 0 but is: -0.5"),
        ({"weight_decay": -0.1}, "weight decay should be >= 0 but is: -0.1"),
        ({"adjust_lr_fn": "nope"}, "Adjust learning rate function nope is not supported"),
        ({"ns_coefficients": "nope"}, "Unknown ns_coefficients preset 'nope'"),
        ({"mode": "nope"}, "mode should be 'owner' or 'gather'"),
    ],
)
def test_bad_hyperparameters(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Muon([nn.Parameter(torch.randn(4, 4))], **kwargs)


def test_errors_name_the_parameter() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match=r"'0.bias'.*\"algorithm\": \"adamw\""):
        Muon(model.named_parameters())
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients: 'w'"):
        Muon([("w", p)]).step()


def test_hyperparameters_changed_after_init_are_checked_at_step() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    opt = Muon([p])
    opt.param_groups[0]["lr"] = -3.0
    with pytest.raises(ValueError, match="Learning rate should be >= 0 but is: -3.0"):
        opt.step()


def test_state_is_created_eagerly_and_skipped_params_stay_untouched() -> None:
    a, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5))
    groups: list[dict[str, Any]] = [{"params": [a]}, {"params": [b], "algorithm": "adamw"}]
    opt = Muon(groups)
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}
    assert set(opt.state_dict()["state"][1]) == {"step", "exp_avg", "exp_avg_sq"}
    before = a.detach().clone()
    b.grad = torch.randn(5)
    opt.step()
    assert (
        torch.equal(a, before)
        and int(opt.state[b]["step"]) == 1
        and int(opt.state[a]["momentum_buffer"].abs().sum()) == 0
    )


def test_zero_gradient_step_with_lr_zero_changes_nothing() -> None:
    """What torch.distributed.checkpoint's set_state_dict does on an optimizer without state."""
    p = nn.Parameter(torch.randn(6, 4))
    p.grad = torch.zeros(6, 4)
    before = p.detach().clone()
    Muon([p], lr=0.0).step()
    assert torch.equal(p, before) and not p.isnan().any()


def test_closure_scheduler_zero_grad_and_frozen_params() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)
    opt = Muon(split_params(model), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def closure() -> Any:  # the loss tensor (torch types a closure's loss as a float)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    losses = [float(cast(torch.Tensor, opt.step(closure)).detach()) for _ in range(5)]
    for _ in range(5):
        sched.step()
    assert losses[-1] < losses[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**5)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_split_params_default_rule_and_overrides() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.proj = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)
            self.lm_head = nn.Linear(8, 10, bias=False)

    groups = split_params(Tiny())
    names = {g["algorithm"]: [n for n, _ in g["params"]] for g in groups}
    assert names["muon"] == ["proj.weight"]
    assert names["adamw"] == ["embed.weight", "proj.bias", "norm.weight", "norm.bias", "lm_head.weight"]
    groups = split_params(Tiny(), muon=["lm_head.*"], adamw=["proj.*"], adamw_options={"lr": 1e-4})
    names = {g["algorithm"]: [n for n, _ in g["params"]] for g in groups}
    assert names["muon"] == ["lm_head.weight"] and groups[1]["lr"] == 1e-4


def test_duplicate_parameter_warning_like_torch() -> None:
    p = nn.Parameter(torch.randn(2, 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Muon([p, p])
    assert any("duplicate parameters" in str(w.message) for w in seen)
