"""Settings that can only produce NaN, or that the step would misread, are refused with a message
naming the setting, the value and the fix: at construction, in a param group, and when set later
(checked again by the step, on every rank: tests/optim/test_set_later.py shows the step's raise reaches
every rank). One process: these checks are local."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from muon_dtensor import Muon

INF, NAN = math.inf, math.nan

# (keyword, value, the message's pattern: the setting, the value, the fix)
CASES: list[tuple[str, Any, str]] = [
    ("lr", INF, r"lr should be finite but is: inf.*use a finite"),
    ("lr", NAN, r"Learning rate should be >= 0 but is: nan"),
    ("momentum", INF, r"momentum should be finite but is: inf"),
    ("weight_decay", INF, r"weight_decay should be finite but is: inf"),
    ("eps", NAN, r"eps should be a finite number >= 0 but is: nan"),
    ("eps", INF, r"eps should be a finite number >= 0 but is: inf"),
    ("ns_coefficients", (NAN, -4.775, 2.0315), r"ns_coefficients should be finite numbers but hold: nan"),
    ("ns_coefficients", [(3.4, -4.7, 2.0), (1.0, INF, 0.5)], r"ns_coefficients.*hold: 1.0, inf, 0.5"),
    (
        "max_round_bytes",
        0,
        r"max_round_bytes should be None \(one round\) or an int >= 1 .* but is: 0; the default",
    ),
    ("max_round_bytes", -1, r"max_round_bytes should be None.*but is: -1"),
    ("max_round_bytes", NAN, r"max_round_bytes should be None.*but is: nan"),
    ("max_round_bytes", 1.5, r"max_round_bytes should be None.*but is: 1.5"),
    ("max_round_bytes", "x", r"max_round_bytes should be None.*but is: 'x'"),
    ("max_round_bytes", True, r"max_round_bytes should be None.*but is: True"),
    ("nesterov", "no", r"nesterov should be True or False but is: 'no'"),
    ("ns_steps", True, r"ns_steps should be an int .* but is: True"),
    ("ns_steps", 2.5, r"ns_steps should be an int .* but is: 2.5"),
]
GROUP_CASES: list[tuple[str, Any, str]] = [
    ("flatten", "yes", r"'flatten' should be True or False but is: 'yes'"),
    ("experts", 1, r"'experts' should be True or False but is: 1"),
]


def _param() -> torch.Tensor:
    return torch.nn.Parameter(torch.randn(4, 4))


@pytest.mark.parametrize(("key", "value", "pattern"), CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES])
def test_refused_at_construction(key: str, value: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Muon([_param()], **{key: value})


@pytest.mark.parametrize(
    ("key", "value", "pattern"), CASES + GROUP_CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES + GROUP_CASES]
)
def test_refused_in_a_param_group(key: str, value: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Muon([{"params": [_param()], key: value}])


@pytest.mark.parametrize(
    ("key", "value", "pattern"), CASES + GROUP_CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES + GROUP_CASES]
)
def test_refused_when_set_later_and_nothing_changes(key: str, value: Any, pattern: str) -> None:
    p = _param()
    opt = Muon([p], lr=0.02)
    p.grad = torch.randn(4, 4)
    before = p.detach().clone()
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=pattern):
        opt.step()
    assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("key", ["lr", "weight_decay", "eps"])
def test_adamw_group_refuses_infinity(key: str) -> None:
    with pytest.raises(ValueError, match=rf"{key} should be finite but is: inf|{key}.*inf"):
        Muon([{"params": [torch.nn.Parameter(torch.randn(3))], "algorithm": "adamw", key: INF}])


@pytest.mark.parametrize("group", ["x", 3, object()])
def test_process_group_must_be_a_process_group(group: Any) -> None:
    with pytest.raises(
        TypeError, match=r"process_group should be None .* or a torch.distributed.ProcessGroup"
    ):
        Muon([_param()], process_group=group)


def test_finite_values_still_train() -> None:
    """The limits refuse only what cannot work: large finite values, presets, None rounds pass."""
    p = _param()
    opt = Muon(
        [p],
        lr=1e3,
        momentum=0.99,
        weight_decay=1e-3,
        eps=0.0,
        max_round_bytes=None,
        ns_coefficients="polar_express",
        ns_steps=0,
    )
    p.grad = torch.randn(4, 4)
    opt.step()
    assert bool(torch.isfinite(p).all())
