"""A value set in a param group after some steps steps exactly as the constructor's, with each
group's settings resolved only when they change (``checks/settings_cache.py``).

The step used to re-check every group and rebuild its Newton-Schulz config and its ``MuonHyper``
every step. Now a group keeps them with a key of the values they came from, so each case here
changes a value after the cache is warm: after the first step, changed back, a tensor lr filled in
place, a list changed in place, a preset name then a list. The reference for each step is an
optimizer built by the constructor with that step's values, carrying the run's state so far.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from muon_dtensor import Muon
from muon_dtensor.checks import settings_cache
from muon_dtensor.optim.state import MOMENTUM
from tests.helpers.stage_layouts import gradient

SHAPES = [(24, 40), (40, 24), (16, 16)]
KELLER = (3.4445, -4.7750, 2.0315)
MILD, MILDER = (3.0, -3.2, 1.2), (2.0, -1.5, 0.5)  # per-step triples that keep the iteration finite


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params: list[nn.Parameter], step: int) -> None:
    for i, p in enumerate(params):
        p.grad = gradient(f"w{i}", tuple(p.shape), step)


def _switched(start: dict[str, Any], changes: dict[int, Any], steps: int = 4) -> list[torch.Tensor]:
    """One optimizer; before step s, ``changes[s]`` (a dict to set on the group, or a callable of
    the group) is applied to its param group."""
    params = _params()
    opt = Muon(params, **start)
    for step in range(steps):
        change = changes.get(step)
        if callable(change):
            change(opt.param_groups[0])
        elif change is not None:
            opt.param_groups[0].update(change)
        _grads(params, step)
        opt.step()
    return [p.detach().clone() for p in params] + [opt.state[p][MOMENTUM].clone() for p in params]


def _constructed(values: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Step s by an optimizer the constructor built with ``values[s]``, given the run's parameters
    and momentum so far (a new optimizer wherever the values change)."""
    params = _params()
    opt: Muon | None = None
    built: dict[str, Any] | None = None
    for step, kw in enumerate(values):
        if kw != built:
            fresh = Muon(params, **kw)
            if opt is not None:
                for p in params:
                    fresh.state[p][MOMENTUM].copy_(opt.state[p][MOMENTUM])
            opt, built = fresh, kw
        _grads(params, step)
        assert opt is not None
        opt.step()
    assert opt is not None
    return [p.detach().clone() for p in params] + [opt.state[p][MOMENTUM].clone() for p in params]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


BASE: dict[str, Any] = {"lr": 0.02}
# (start, change after step 1, the constructor's value for steps 1..3)
AFTER_ONE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "lr": ({"lr": 0.05}, {"lr": 0.05}),
    "momentum": ({"momentum": 0.8}, {"momentum": 0.8}),
    "weight_decay": ({"weight_decay": 0.3}, {"weight_decay": 0.3}),
    "nesterov": ({"nesterov": False}, {"nesterov": False}),
    "ns_steps": ({"ns_steps": 3}, {"ns_steps": 3}),
    "eps": ({"eps": 100.0}, {"eps": 100.0}),  # above the inputs' norms: it changes the step
    "adjust_lr_fn_name": ({"adjust_lr_fn": "match_rms_adamw"}, {"adjust_lr_fn": "match_rms_adamw"}),
    "adjust_lr_fn_number": ({"adjust_lr_fn": 0.3}, {"adjust_lr_fn": 0.3}),
    "ns_dtype_as_dtype": ({"ns_dtype": torch.float32}, {"ns_dtype": torch.float32}),
    "ns_dtype_as_name": ({"ns_dtype": "float32"}, {"ns_dtype": torch.float32}),
    "preset_name": ({"ns_coefficients": "polar_express"}, {"ns_coefficients": "polar_express"}),
    "triple": ({"ns_coefficients": (3.0, -3.2, 1.2)}, {"ns_coefficients": (3.0, -3.2, 1.2)}),
}


@pytest.mark.parametrize("case", list(AFTER_ONE))
def test_a_value_set_after_the_first_step_steps_as_the_constructors(case: str) -> None:
    change, built = AFTER_ONE[case]
    switched = _switched(BASE, {1: change})
    assert _same(switched, _constructed([BASE] + [BASE | built] * 3))
    assert not _same(switched, _switched(BASE, {}))  # the change did change the run


def test_a_value_changed_and_changed_back_steps_as_the_constructors() -> None:
    switched = _switched(BASE, {1: {"lr": 0.05, "ns_steps": 3}, 2: {"lr": 0.02, "ns_steps": 5}})
    expected = _constructed([BASE, BASE | {"lr": 0.05, "ns_steps": 3}, BASE, BASE])
    assert _same(switched, expected)


def test_a_preset_name_then_a_list_then_the_list_changed_in_place() -> None:
    """The key holds a list's contents, not the list: a list changed in place is a new value."""
    coefficients = [KELLER, MILD]

    def edit(group: dict[str, Any]) -> None:
        group["ns_coefficients"][1] = MILDER  # the same list object, new contents

    switched = _switched(
        BASE, {1: {"ns_coefficients": "polar_express"}, 2: {"ns_coefficients": coefficients}, 3: edit}
    )
    expected = _constructed(
        [BASE, BASE | {"ns_coefficients": "polar_express"}, BASE | {"ns_coefficients": [KELLER, MILD]},
         BASE | {"ns_coefficients": [KELLER, MILDER]}]
    )  # fmt: skip
    assert _same(switched, expected)


def test_a_tensor_lr_filled_in_place_steps_as_the_constructors_float() -> None:
    lr = torch.tensor(0.02)
    switched = _switched({"lr": lr}, {1: lambda g: lr.fill_(0.05), 3: lambda g: lr.fill_(0.02)})
    expected = _constructed([{"lr": 0.02}, {"lr": 0.05}, {"lr": 0.05}, {"lr": 0.02}])
    assert _same(switched, expected)


@pytest.mark.filterwarnings("ignore:momentum buffers found")
@pytest.mark.parametrize("value", [torch.bfloat16, "bfloat16"])
def test_a_momentum_dtype_set_after_the_first_step_steps_as_the_constructors(value: Any) -> None:
    switched = _switched(BASE, {1: {"momentum_dtype": value}})
    assert _same(switched, _constructed([BASE] + [BASE | {"momentum_dtype": torch.bfloat16}] * 3))


@pytest.mark.parametrize(
    ("key", "value", "pattern"),
    [
        ("nesterov", 1, r"nesterov should be True or False but is: 1"),  # 1 == True: the key must not say so
        ("lr", math.nan, r"Learning rate should be >= 0 but is: nan"),
        ("ns_steps", 5.0, r"ns_steps should be an int"),  # 5.0 == 5
        ("ns_coefficients", [KELLER, (1.0, math.inf, 0.5)], r"ns_coefficients.*hold: 1.0, inf, 0.5"),
    ],
)
def test_a_bad_value_set_after_a_step_is_refused_at_every_later_step(
    key: str, value: Any, pattern: str
) -> None:
    params = _params()
    opt = Muon(params, lr=0.02)
    _grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0][key] = value
    for step in (1, 2):  # refused again: a group whose checks failed keeps no settings
        _grads(params, step)
        with pytest.raises(ValueError, match=pattern):
            opt.step()
    assert _same([p.detach() for p in params], before)


def test_a_steady_step_resolves_no_group_and_a_change_resolves_that_group_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count that showed the rebuild: every step checked every group and built its config."""
    calls: list[int] = []
    real = settings_cache.check_group

    def counted(group: Any, index: int | None = None) -> Any:
        calls.append(-1 if index is None else index)
        return real(group, index)

    monkeypatch.setattr(settings_cache, "check_group", counted)
    params, bias = _params(), nn.Parameter(torch.zeros(3))
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = Muon(groups, lr=0.02)
    per_step = []
    for step in range(5):
        if step == 3:
            opt.param_groups[1]["lr"] = 1e-3
        _grads(params, step)
        bias.grad = torch.ones(3)
        calls.clear()
        opt.step()
        per_step.append(list(calls))
    assert per_step == [[0, 1], [], [], [1], []]
