"""A value set in a param group after construction behaves exactly as the same value given to the
constructor: ``validation.normalize_group`` runs before every step's checks. Before it, a group
switched to int8 momentum with ``torch.int8`` (the form ``Muon(momentum_dtype=...)`` takes) had its
buffer converted but stepped as a float buffer: the momentum decayed and took no new gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from muon_dtensor import Muon
from muon_dtensor.optim.state import MOMENTUM, MOMENTUM_ABSMAX
from tests.helpers.stage_layouts import gradient

SHAPE = (64, 300)  # two blocks of int8 momentum per row, the second partial


def _run(
    built: torch.dtype | None, switch: Any = None, at: int = 0, steps: int = 4, **kw: Any
) -> dict[str, Any]:
    """``steps`` steps of one matrix; ``switch`` set as the group's ``momentum_dtype`` before step ``at``."""
    w = nn.Parameter(torch.randn(*SHAPE, generator=torch.Generator().manual_seed(3)))
    opt = Muon([w], lr=0.02, momentum_dtype=built, **kw)
    for step in range(steps):
        if switch is not None and step == at:
            opt.param_groups[0]["momentum_dtype"] = switch
        w.grad = gradient("w", SHAPE, step)
        opt.step()
    return {
        "w": w.detach().clone(),
        **{k: v.clone() for k, v in opt.state[w].items()},
        "group": opt.param_groups[0],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = [k for k in a if k != "group"]
    return keys == [k for k in b if k != "group"] and all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.filterwarnings("ignore:momentum buffers found")
@pytest.mark.parametrize("switch", [torch.int8, "int8"])
def test_a_group_switched_to_int8_steps_as_one_built_with_it_bitwise(switch: Any) -> None:
    built = _run(torch.int8)
    switched = _run(None, switch)
    assert switched["group"]["momentum_dtype"] == "int8" == built["group"]["momentum_dtype"]
    assert switched[MOMENTUM].dtype == torch.int8 and MOMENTUM_ABSMAX in switched
    assert _same(switched, built)


def test_a_switch_after_some_steps_is_the_same_with_the_dtype_and_the_name() -> None:
    with pytest.warns(UserWarning, match="float32 -> int8"):
        by_dtype = _run(None, torch.int8, at=2)
    with pytest.warns(UserWarning, match="float32 -> int8"):
        by_name = _run(None, "int8", at=2)
    assert _same(by_dtype, by_name)
    assert not _same(by_dtype, _run(None))  # the switch did change the run


@pytest.mark.filterwarnings("ignore:momentum buffers found")
@pytest.mark.parametrize(("built", "switch"), [(torch.bfloat16, torch.float32), (None, torch.bfloat16)])
def test_float_momentum_dtypes_switched_step_as_built(built: Any, switch: torch.dtype) -> None:
    target = _run(switch)
    switched = _run(built, switch)
    assert switched["group"]["momentum_dtype"] == str(switch).removeprefix("torch.")
    assert _same(switched, target)


def test_ns_dtype_switched_with_the_dtype_steps_as_built() -> None:
    built = _run(None, steps=2, ns_dtype=torch.float32)
    w = nn.Parameter(torch.randn(*SHAPE, generator=torch.Generator().manual_seed(3)))
    opt = Muon([w], lr=0.02)
    opt.param_groups[0]["ns_dtype"] = torch.float32
    for step in range(2):
        w.grad = gradient("w", SHAPE, step)
        opt.step()
    assert opt.param_groups[0]["ns_dtype"] == "float32" and torch.equal(w, built["w"])


@pytest.mark.parametrize("lr", [torch.tensor([0.02]), torch.tensor([[0.02]])])
def test_a_tensor_lr_that_is_not_0_dim_is_refused_at_construction_and_when_set_later(
    lr: torch.Tensor,
) -> None:
    w = nn.Parameter(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"tensor lr should be 0-dim .* has shape"):
        Muon([w], lr=lr)
    opt = Muon([w], lr=torch.tensor(0.02))
    opt.param_groups[0]["lr"] = lr
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"tensor lr should be 0-dim .* has shape"):
        opt.step()
    assert torch.equal(w, before)
