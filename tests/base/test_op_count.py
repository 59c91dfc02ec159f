"""``base/op_count.top_level_ops`` names the same ops as the profiler's own parent tree
(``function_events``' ``cpu_parent``), the count every host-work figure of the project rests on."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from muon_dtensor import Muon
from muon_dtensor.base.op_count import is_op, top_level_ops
from muon_dtensor.numerics.newton_schulz import BATCH_ENV


def by_the_tree(prof: Any) -> Counter[str]:
    """The top-level ops as ``function_events`` finds them: no op among an event's parents."""

    def top(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if is_op(parent.name):
                return False
            parent = parent.cpu_parent
        return True

    return Counter(e.name for e in prof.profiler.function_events if is_op(e.name) and top(e))


def _muon_step(monkeypatch: pytest.MonkeyPatch, batch: str) -> Any:
    """A second Muon step (AdamW group included) on same-shape and lone matrices, profiled."""
    monkeypatch.setenv(BATCH_ENV, batch)
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(12, 40)] * 3 + [(24, 24)]]
    bias = nn.Parameter(torch.zeros(24))
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = Muon(groups, lr=0.02)
    for _ in range(2):
        for p in [*params, bias]:
            p.grad = torch.randn(p.shape, generator=gen)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
    return prof


@pytest.mark.parametrize("batch", ["never", "always"])
def test_a_muon_step_counts_as_the_tree_does(monkeypatch: pytest.MonkeyPatch, batch: str) -> None:
    prof = _muon_step(monkeypatch, batch)
    tree = by_the_tree(prof)
    assert Counter(top_level_ops(prof)) == tree
    assert sum(tree.values()) > 20  # ops were seen, and many nest others (the step's foreach ops)
    assert sum(1 for e in prof.profiler.function_events if is_op(e.name)) > sum(tree.values())


def test_ops_under_annotations_and_in_other_threads_count_once() -> None:
    """An op inside a ``record_function`` block is top-level; one inside another op is not
    (``linear`` runs ``addmm`` inside); each thread nests its own."""
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)

    def work() -> None:
        with record_function("outer"):
            torch.nn.functional.linear(x, w, b)
            with record_function("inner"):
                (x @ w).sum()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    ours, tree = Counter(top_level_ops(prof)), by_the_tree(prof)
    assert ours == tree
    assert "aten::linear" in ours and "aten::addmm" not in ours  # addmm runs inside linear
    assert ours["aten::sum"] == ours["aten::linear"] >= 1
