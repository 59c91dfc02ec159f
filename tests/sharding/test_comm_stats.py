"""``print(opt.comm_stats)`` shows its figures, not an object address."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import build

TIMEOUT = 120.0  # seconds for the 2-rank call
FIELDS = ("sent", "received", "collectives", "orthogonalized", "peak_bytes")


def _figures(stats: Any) -> dict[str, int]:
    return {name: getattr(stats, name) for name in FIELDS}


def _shown(text: str) -> dict[str, int]:
    match = re.fullmatch(r"CommStats\((.*)\)", text)
    assert match, f"not CommStats(...): {text!r}"
    return {k: int(v) for k, v in (part.split("=") for part in match.group(1).split(", "))}


def test_repr_lists_every_figure() -> None:
    opt = Muon([nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4, 8))], lr=0.02)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.step()
    text = repr(opt.comm_stats)
    assert str(opt.comm_stats) == text and " object at 0x" not in text
    assert _shown(text) == _figures(opt.comm_stats)
    assert opt.comm_stats.orthogonalized == 2


def _step_and_show() -> tuple[str, dict[str, int]]:
    """Rank function: one sharded step; the repr and the figures."""
    model = build((2,))
    opt = Muon(split_params(model), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return repr(opt.comm_stats), _figures(opt.comm_stats)


def test_repr_after_a_sharded_step() -> None:
    for text, figures in run_ranks(_step_and_show, 2, timeout=TIMEOUT):
        assert _shown(text) == figures
        assert figures["sent"] > 0 and figures["collectives"] > 0
