"""One pass over a parameter's layout (issue 50, item 6): the set-up reads each parameter's layout
facts once into a ``LayoutRecord`` (mesh, placements, global and local shapes, the axes that shard
it, its replica count, its blocks), and the owner policy, the owner pricing and ``describe`` read
the record. Before, the first step's set-up called into ``param_layout`` about 6 times per FSDP
parameter and 9 per HSDP one (``benchmarks/setup_walk.py``), to ask one more fact each time. One
process on the fake backend."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from muon_dtensor import Muon
from muon_dtensor.optim import group_sharding
from muon_dtensor.sharding.plan import param_layout
from muon_dtensor.sharding.plan.blocks import AxisShard, mesh_blocks, shard_blocks
from muon_dtensor.sharding.plan.param_layout import describe, read_layout


def _hsdp(rows: int, grad: bool = False) -> Any:
    """A ``(rows, 8)`` parameter sharded by rows over 8 ranks, replicated twice; ``rows`` = 4 x 8."""
    mesh = init_device_mesh("cpu", (2, 8))
    local = torch.randn(rows // 8, 8)
    p = nn.Parameter(
        DTensor.from_local(local, mesh, [Replicate(), Shard(0)], shape=torch.Size((rows, 8)), stride=(8, 1))
    )
    if grad:
        p.grad = DTensor.from_local(
            torch.ones(rows // 8, 8), mesh, [Replicate(), Shard(0)], shape=p.shape, stride=(8, 1)
        )
    return p


def test_the_record_holds_what_describe_asked_for(fake_world: None) -> None:
    p = _hsdp(32)
    record = read_layout(p, "w")
    shards = (AxisShard(1, 0, 8),)
    assert (record.mesh, record.mesh_shape, record.placements) == (p.device_mesh, (2, 8), tuple(p.placements))
    assert (record.shape, record.local_shape, record.local_numel) == ((32, 8), (4, 8), 32)
    assert (record.shards, record.replicas, record.axes) == (shards, 2, (1,))
    assert record.blocks is shard_blocks((32, 8), shards)  # one tuple per layout, shared
    for across in (False, True):
        assert describe(record, "w", None, across, planned=True) == describe(
            p, "w", None, across, planned=True
        )
    assert describe(record, "w", None, True, planned=True).blocks == mesh_blocks((32, 8), (2, 8), shards)[0]
    plain = read_layout(torch.zeros(3, 5), "b")
    assert (plain.mesh, plain.replicas, plain.local_shape, len(plain.blocks)) == (None, 1, (3, 5), 1)


def test_a_refused_layout_names_the_parameter(fake_world: None) -> None:
    mesh = init_device_mesh("cpu", (16,))
    p = DTensor.from_local(torch.zeros(4, 8), mesh, [Shard(0)], shape=torch.Size((32, 8)), stride=(8, 1))
    record = read_layout(p, "layers.0.w")
    with pytest.raises(ValueError, match=r"'layers.0.w'.*local shape \(4, 8\).*expected \(2, 8\)"):
        describe(record, "layers.0.w", None, planned=True)


def test_the_set_up_reads_each_parameter_once(fake_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step reads each parameter's record once (owners ``"auto"`` prices HSDP through
    it); a steady step reads none."""
    reads: list[str] = []

    def counted(p: Any, name: str) -> Any:
        reads.append(name)
        return read_layout(p, name)

    monkeypatch.setattr(group_sharding, "read_layout", counted)
    monkeypatch.setattr(param_layout, "read_layout", counted)
    params = [_hsdp(32, grad=True), _hsdp(64, grad=True), _hsdp(32, grad=True)]
    opt = Muon(params, lr=0.02)
    opt.step()
    assert reads == [f"param_groups[0]['params'][{i}]" for i in range(3)]
    opt.step()
    assert len(reads) == 3
