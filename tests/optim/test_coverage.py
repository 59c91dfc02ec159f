"""Coverage with no silent fallback: ``Muon.describe()`` (logged once, on rank 0) and
``split_params`` refusing a model with no Muon matrix or with 2-D weights flattened into 1-D shards."""

from __future__ import annotations

import logging
from typing import cast

import pytest
import torch
from torch import nn

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import Net

TIMEOUT = 120.0


class Heads(nn.Module):
    """q, k, v per head, an expert stack, an MLP, a norm and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.q_proj = nn.Linear(16, 16, bias=False)
        self.k_proj = nn.Linear(16, 8, bias=False)
        self.up = nn.Linear(16, 24, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 24, 16))
        self.norm = nn.LayerNorm(16)


def test_describe_names_groups_matrices_and_refusals() -> None:
    model = Heads()
    groups = split_params(model, head_dim=4, adamw=["experts"])
    experts = [(n, p) for n, p in groups[-1]["params"] if n == "experts"]
    groups[-1]["params"] = [(n, p) for n, p in groups[-1]["params"] if n != "experts"]
    opt = Muon([*groups, {"params": experts, "algorithm": "muon", "experts": True}], lr=0.02)
    text = opt.describe()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    # group 0: the MLP matrix; group 1: q and k cut into 4 + 2 heads; group 3: 3 experts
    assert "| 0 | muon | - | 1 | 384 | 1 |" in rows["0"]
    assert "| 1 | muon | head_dim=4 | 2 | 384 | 6 |" in rows["1"]
    assert "| 3 | muon | experts=True | 1 | 1,152 | 3 |" in rows["3"]
    # the stack is shown as experts, not as a 3-D tensor
    assert "expert stacks (experts=True; one matrix per expert):" in text
    assert "  experts (group 3): 3 experts of 24x16, whole on this rank (not a DTensor)" in text
    assert "1 ranks: 1.000" in rows["1"]
    assert "embed.weight (10, 16): embedding" in text
    assert "norm.weight (16,): 1-D" in text


def test_describe_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    model = Net()
    opt = Muon(split_params(model), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with caplog.at_level(logging.INFO, logger="muon_dtensor"):
        opt.step()
        opt.step()
    logged = [r.getMessage() for r in caplog.records if r.name == "muon_dtensor"]
    assert logged == [opt.describe()]


def _logged_on_ranks() -> int:
    from tests.helpers.models import build

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign, assignment]
    logger = logging.getLogger("muon_dtensor")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    model = build((2,))
    opt = Muon(split_params(model), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.step()
    assert "2 ranks" in opt.describe()
    return len(records)


def test_describe_is_logged_on_rank_zero_only() -> None:
    assert run_ranks(_logged_on_ranks, 2, timeout=TIMEOUT) == [1, 0]


def test_no_muon_matrix_is_refused() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.Embedding(4, 8))
    with pytest.raises(ValueError, match=r"yields no Muon matrix.*0\.weight \(8,\).*AdamW alone"):
        split_params(model)
    with pytest.raises(ValueError, match=r"yields no Muon matrix"):
        split_params(Net(), adamw=["*"])


def test_flattened_linear_weights_are_refused() -> None:
    """ZeRO-style flattening: a Linear's weight held as a 1-D shard."""
    model = Net()
    layer = cast(nn.Linear, model.layers[1])
    layer.weight = nn.Parameter(layer.weight.detach().reshape(-1)[:50].clone())
    with pytest.raises(ValueError, match=r"flat 1-D shards: layers\.1\.weight .*\(50,\).*fully_shard"):
        split_params(model)


def _fsdp1_split() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(Net(), device_id=torch.device("cpu"), use_orig_params=False)
    try:
        split_params(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fsdp1_flat_parameter_is_refused() -> None:
    (message,) = run_ranks(_fsdp1_split, 1, timeout=TIMEOUT)
    assert "FlatParameter" in message and "_flat_param" in message and "fully_shard" in message


def _reports_on_rank_zero_only() -> dict[str, object]:
    """``if rank == 0: log(opt.describe(), opt.memory())`` before the first step, the usual way to log
    (it hung both ranks when describe built the plan collectively); then every rank steps."""
    import torch.distributed as dist

    from tests.helpers.models import build

    model = build((2,))
    opt = Muon(split_params(model), lr=0.02)
    before: dict[str, object] = {}
    if dist.get_rank() == 0:
        before = {"describe": opt.describe(), "memory": opt.memory(), "metrics": opt.metrics()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    after = {"describe": opt.describe(), "memory": opt.memory()} if dist.get_rank() == 0 else {}
    return {"before": before, "after": after}


def test_describe_and_memory_on_one_rank_before_the_first_step_are_local() -> None:
    """Local: the plan a report needs before any step is built on that rank alone (no group made, no
    vote), and equals what the first step then builds: the same table and the same figures."""
    first, second = run_ranks(_reports_on_rank_zero_only, 2, timeout=TIMEOUT)
    assert second == {"before": {}, "after": {}}
    before, after = first["before"], first["after"]
    assert isinstance(before, dict) and isinstance(after, dict)
    assert "2 ranks" in str(before["describe"]) and before["describe"] == after["describe"]
    assert before["memory"] == after["memory"]
