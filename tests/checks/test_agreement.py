"""Ranks that build the optimizer differently raise the same error on every rank, naming the field.

Regression: with rank 1 building the optimizer differently from rank 0, 7 of 15 cases diverged
silently (parameters in another order, as a Python ``set`` gives them; another ``lr``,
``weight_decay``, ``nesterov``, ``adjust_lr_fn``, ``ns_steps`` or ``ns_coefficients``) and the others
raised on some ranks only (a group or a parameter present on one rank only; another ``mode``,
``max_round_bytes`` or ``ns_dtype``). All cases run in one pooled 2-rank run; each returns what its
rank raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muon_dtensor import Muon
from tests.harness.ranks import run_ranks

Named = list[tuple[str, nn.Parameter]]


def _params() -> Named:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (6, 4), "b": (6, 4), "c": (5, 3), "d": (0, 4)}
    return [
        (n, nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])))
        for n, s in shapes.items()
    ]


def _step(groups: list[dict[str, Any]], params: Named, **kwargs: Any) -> None:
    opt = Muon(groups, lr=0.02, **kwargs)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def _one_group(
    changed: dict[str, Any] | None = None, reorder: bool = False, named: bool = True
) -> Callable[[], None]:
    def case() -> None:
        params = _params()
        mine = list(reversed(params)) if reorder and dist.get_rank() == 1 else params
        group: dict[str, Any] = {"params": mine if named else [p for _, p in mine]}
        if dist.get_rank() == 1:
            group.update(changed or {})
        _step([group], params)

    return case


def _extra_group() -> None:
    params = _params()
    groups: list[dict[str, Any]] = [{"params": params[:2]}, {"params": params[2:]}]
    if dist.get_rank() == 1:
        groups = [{"params": params}]
    _step(groups, params)


def _local_adamw_lr_differs() -> None:
    """Allowed: AdamW on plain tensors is stepped locally, so its settings may differ by rank."""
    params = _params()
    plain = nn.Parameter(torch.randn(3))
    plain.grad = torch.ones(3)
    lr = 0.1 if dist.get_rank() == 1 else 0.01
    _step([{"params": params}, {"params": [("bias", plain)], "algorithm": "adamw", "lr": lr}], params)


CASES: dict[str, tuple[Callable[[], None], str | None]] = {
    "agree": (_one_group(), None),
    "param_order_named": (_one_group(reorder=True), r"param group 0 parameters \(name, layout\): \('a'"),
    "param_order_unnamed": (_one_group(reorder=True, named=False), r"parameters \(name, layout\)"),
    "lr": (_one_group({"lr": 0.03}), r"param group 0 'lr': 0.02 vs 0.03"),
    "weight_decay": (_one_group({"weight_decay": 0.0}), r"'weight_decay': 0.1 vs 0.0"),
    "nesterov": (_one_group({"nesterov": False}), r"'nesterov': True vs False"),
    "adjust_lr_fn": (_one_group({"adjust_lr_fn": "match_rms_adamw"}), r"'adjust_lr_fn': None vs 'match_rms"),
    "ns_steps": (_one_group({"ns_steps": 4}), r"'ns_steps': 5 vs 4"),
    "ns_coefficients": (_one_group({"ns_coefficients": "you"}), r"'ns_coefficients': \(3.4445.* vs 'you'"),
    "mode": (_one_group({"mode": "gather"}), r"'mode': 'owner' vs 'gather'"),
    "max_round_bytes": (_one_group({"max_round_bytes": None}), r"'max_round_bytes': 4194304 vs None"),
    "ns_dtype": (_one_group({"ns_dtype": torch.float32}), r"'ns_dtype': 'bfloat16' vs 'float32'"),
    "extra_group": (_extra_group, r"param groups holding parameters here: \[0, 1\] vs \[0\]"),
    "local_adamw_lr": (_local_adamw_lr_differs, None),
}


def run_cases() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (case, _) in CASES.items():
        try:
            case()
            out[name] = ("none", "")
        except Exception as e:  # noqa: BLE001 - every case reports what it raised
            out[name] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str, str]]]:
    return run_ranks(run_cases, 2, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_disagreement_raises_on_every_rank(case: str, outcomes: list[dict[str, tuple[str, str]]]) -> None:
    pattern = CASES[case][1]
    for rank, per_case in enumerate(outcomes):
        kind, message = per_case[case]
        if pattern is None:
            assert kind == "none", f"rank {rank}: {message}"
            continue
        assert kind == "ValueError", f"rank {rank} raised {kind}: {message}"
        assert "ranks disagree about the optimizer" in message, message
        assert __import__("re").search(pattern, message), f"rank {rank}: {message}"


def test_zero_size_matrix_steps_as_torch_does() -> None:
    """A 0 x n parameter in a Muon group is a no-op step with state, as in torch.optim.Muon
    (it raised a confusing split_sizes error)."""
    ours, theirs = nn.Parameter(torch.zeros(0, 5)), nn.Parameter(torch.zeros(0, 5))
    for p in (ours, theirs):
        p.grad = torch.zeros(0, 5)
    Muon([ours]).step()
    torch.optim.Muon([theirs]).step()
    assert ours.shape == theirs.shape and set(Muon([ours]).state[ours]) == {"momentum_buffer"}


def test_an_explanation_over_a_gather_that_moved_nothing_says_so() -> None:
    """Issue 49 item 7: over a size-2 fake axis the gather hands back this rank's entries for both
    ranks, and the text said "ranks that agree: [0, 1]" of ranks it had never heard from."""
    from muon_dtensor.checks.agreement import explain

    entry: Any = [(0, (("lr", 0.02),), ())]
    other: Any = [(0, (("lr", 0.03),), ())]
    with pytest.raises(ValueError) as caught:
        explain("the mesh", entry, {0: entry, 1: entry})
    text = str(caught.value)
    assert "ranks that agree" not in text and "are all this rank's" in text and "[0, 1]" in text, text
    with pytest.raises(ValueError, match=r"'lr': 0.02 vs 0.03 \(ranks that agree: \[0\] \| \[1\]\)"):
        explain("the mesh", entry, {0: entry, 1: other})
