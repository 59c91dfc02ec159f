"""``Muon.memory()``: state bytes per kind, exactly; the predicted peak of a step's transients against
tensor-byte accounting of a real step (tests/helpers/allocations.py), on one process and on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.planning.plans import hsdp_plan, sharded_plan
from muon_dtensor.sharding.plan.blocks import block_numel
from muon_dtensor.sharding.plan.build import build_plan
from muon_dtensor.sharding.plan.memory import round_sizes
from muon_dtensor.sharding.plan.param_layout import local_of
from muon_dtensor.sharding.plan.routes import build_routes
from tests.harness.ranks import run_ranks
from tests.helpers.allocations import LiveBytes
from tests.helpers.host import ns_dtype_here

TIMEOUT = 180.0
TOLERANCE = 0.10  # the bound on predicted against measured peak
# The one-process tests run Newton-Schulz in this host's faster dtype (``ns_dtype_here``, measured
# when the first of them runs): where bf16 is emulated, the Stack's bf16 iteration takes 2.9 CPU s
# against 0.1 in float32, and the prediction is claimed for either. The 2-rank tests keep the
# default bf16 (and its 2-byte workspace) on every host.


class Stack(nn.Module):
    """Matrices of several shapes (wide, tall, square, one with fewer rows than ranks), norms, a head."""

    def __init__(self) -> None:
        super().__init__()
        widths = [(192, 320), (320, 256), (256, 256), (256, 448), (448, 192), (192, 3)]
        self.layers = nn.ModuleList([nn.Linear(a, b, bias=False) for a, b in widths])
        self.norm = nn.LayerNorm(3)
        self.lm_head = nn.Linear(3, 50, bias=False)


def _stepped(model: nn.Module, **options: Any) -> tuple[Muon, int, dict[str, int]]:
    """Muon over ``model`` after one step (layouts built); then a second step measured."""
    torch.manual_seed(0)
    opt = Muon(split_params(model), lr=0.02, **options)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    predicted = opt.memory()
    with LiveBytes() as measured:
        opt.step()
    return opt, measured.peak, predicted


def _state_total(opt: Muon) -> int:
    return sum(
        local_of(v).numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def _check(opt: Muon, measured: int, predicted: dict[str, int], momentum_item: int = 4) -> None:
    persistent = {k: v for k, v in predicted.items() if k != "peak_transient"}
    assert sum(persistent.values()) == _state_total(opt)
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    assert persistent["momentum"] == sum(local_of(p).numel() * momentum_item for p in muon)
    peak = predicted["peak_transient"]
    assert abs(peak - measured) <= TOLERANCE * measured, (peak, measured)


@pytest.mark.parametrize("max_round_bytes", [None, 300_000])
def test_one_process(max_round_bytes: int | None) -> None:
    _check(*_stepped(Stack(), max_round_bytes=max_round_bytes, ns_dtype=ns_dtype_here()))


@pytest.mark.parametrize("model", ["stack", "many_small"])
def test_one_process_bf16_momentum(model: str) -> None:
    """Half the momentum bytes of fp32 parameters. 200 small matrices make the momentum update the
    step's peak: the wide working copy of a bucket, its scaled gradient and Nesterov source."""
    torch.manual_seed(0)
    net = Stack() if model == "stack" else nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(200)))
    _check(*_stepped(net, momentum_dtype=torch.bfloat16, ns_dtype=ns_dtype_here()), momentum_item=2)


@pytest.mark.parametrize("model", ["stack", "many_small"])
def test_one_process_int8_momentum(model: str) -> None:
    """A byte per element and a float32 maximum per block of 256 columns. The momentum pass's peak
    is one stacked chunk's float32 copies (shapes whose rows end in a short block included)."""
    torch.manual_seed(0)
    net = Stack() if model == "stack" else nn.Sequential(*(nn.Linear(32, 32, bias=False) for _ in range(200)))
    opt, measured, predicted = _stepped(net, momentum_dtype=torch.int8, ns_dtype=ns_dtype_here())
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    assert predicted["momentum"] == sum(p.numel() + 4 * p.shape[0] * -(-p.shape[1] // 256) for p in muon)
    assert sum(predicted.values()) - predicted["peak_transient"] == _state_total(opt)
    assert abs(predicted["peak_transient"] - measured) <= TOLERANCE * measured, (predicted, measured)


def _on_ranks(max_round_bytes: int | None) -> tuple[int, int, int]:
    """Rank function: FSDP2 on 2 ranks; checks this rank's figures, returns the measured and
    predicted peaks and the rounds of the plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack()
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, measured, predicted = _stepped(model, max_round_bytes=max_round_bytes)
    _check(opt, measured, predicted)
    (domain,) = opt._plans.entries[0].sharding.domains(list(range(6)), "owner", max_round_bytes)
    return measured, predicted["peak_transient"], len(domain.plan.rounds)


@pytest.mark.parametrize(("max_round_bytes", "rounds"), [(None, 1), (300_000, 3)])
def test_two_ranks(max_round_bytes: int | None, rounds: int) -> None:
    """Exchange buffers, owned full matrices and Newton-Schulz workspace on every rank; with 3
    pipelined rounds, two rounds' buffers at once."""
    for measured, predicted, planned in run_ranks(_on_ranks, 2, max_round_bytes, timeout=TIMEOUT):
        assert planned == rounds
        assert abs(predicted - measured) <= TOLERANCE * measured, (predicted, measured)


def test_round_sizes_match_the_routes() -> None:
    """The plan-side figures equal the sizes of the buffers the routes describe, on every rank of
    uneven FSDP (72 rows on 16 ranks, a [1, 96] weight) and HSDP plans of several rounds."""
    shapes = [(72, 64), (1, 96), (40, 40), (96, 24)] * 10
    plans = [
        sharded_plan(shapes, 16, max_round_bytes=20_000),
        hsdp_plan(shapes, 4, 2, max_round_bytes=20_000),
    ]
    plans.append(build_plan(plans[0].entries, 16, "gather"))
    for plan in plans:
        assert len(plan.rounds) > 1 or plan.mode == "gather"
        for me in range(plan.group_size):
            for sizes, route in zip(round_sizes(plan, me), build_routes(plan, me), strict=True):
                mine = [block_numel(plan.entries[m].blocks[me]) for ms in route.inbound.sends for m in ms]
                assert sizes.send_in == sum(mine)
                assert sizes.recv_in == sum(route.inbound.recv_numels)
                assert sizes.recv_out == sum(route.outbound.recv_numels)
                assert sizes.send_out == sum(route.outbound.send_numels)
                stacked = sum(len(ms) * shape[0] * shape[1] for shape, ms in route.inbound.stacks)
                assert sizes.full == (0 if route.inbound.direct else stacked)
