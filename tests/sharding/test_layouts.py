"""Every sharding layout gives the one-process step exactly: TP, FSDP x TP, 3-D meshes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.optim.group_sharding import layout_of
from tests.harness.ranks import run_ranks
from tests.helpers.models import MLP, dt, model_grads, shard_mlp, step_together

LAYOUTS = [
    ((4,), ("tp",)),
    ((2, 2), ("dp", "tp")),
    ((1, 4), ("dp", "tp")),
    ((2, 1, 2), ("replicate", "shard", "tp")),
    ((1, 2, 2), ("replicate", "shard", "tp")),
]


@pytest.mark.parametrize(("mesh_shape", "names"), LAYOUTS, ids=[str(m) for m, _ in LAYOUTS])
def test_tp_layouts_equal_single_process(mesh_shape: tuple, names: tuple) -> None:
    results = run_ranks(tp_exactness, 4, mesh_shape, names)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']} (placements {r['placements']})"
    if names == ("dp", "tp") and mesh_shape == (2, 2):
        placements = results[0]["placements"]
        assert "_StridedShard" in placements["w1.weight"], placements  # FSDP over colwise TP
        assert placements["w2.weight"] == "(Shard(dim=0), Shard(dim=1))", placements


@pytest.mark.parametrize(("mesh_shape", "names"), LAYOUTS[:3], ids=[str(m) for m, _ in LAYOUTS[:3]])
def test_blocks_are_what_dtensor_holds(mesh_shape: tuple, names: tuple) -> None:
    for rank, bad in enumerate(run_ranks(blocks_match_dtensor, 4, mesh_shape, names)):
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp_checkpoint_resumes_on_fsdp_x_tp(tmp_path: Path) -> None:
    """Saved by FSDP on 4 ranks, resumed by FSDP x TP on a 2x2 mesh: equal gradients make every
    layout the one-process run, so the resumed run ends bitwise where one process ends."""
    run_ranks(save_mlp, 4, str(tmp_path), (4,), ("dp",), 2)
    for rank, bad in enumerate(run_ranks(resume_mlp, 4, str(tmp_path), (2, 2), ("dp", "tp"), 4)):
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp_x_tp_training_tracks_single_process() -> None:
    """Real backward passes: TP sums partial products and FSDP averages over dp in other orders than
    one process, so gradients differ by float32 rounding (checked at step 0). Newton-Schulz then
    amplifies bfloat16-level differences along small singular directions (slope up to a^5, about
    490 for Keller's coefficients), so parameters are checked against a few updates' size
    (lr 0.02 x sqrt(2) per step) and the loss against 2e-3."""
    results = run_ranks(train_fsdp_tp, 4)
    ref = results[0]["ref_losses"]
    assert ref[-1] < ref[0]
    # ranks 0-1 hold the first half of each batch, ranks 2-3 the second: their mean is the batch loss
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"])]
    assert max(abs(a - b) for a, b in zip(mean, ref)) <= 2e-3, (mean, ref)
    assert max(r["grad_gap"] for r in results) <= 1e-5
    assert max(r["gap"] for r in results) <= 0.03


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _piece(full: torch.Tensor, block: Any) -> torch.Tensor:
    for d, intervals in enumerate(block):
        full = full.index_select(d, torch.cat([torch.arange(a, b) for a, b in intervals]))
    return full


def cut_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A full gradient cut to ``p``'s layout by our blocks (distribute_tensor refuses uneven strided
    shards); blocks_match_dtensor checks those blocks against DTensor's own placement."""
    if not isinstance(p, DTensor):
        return g
    layout = layout_of(p, "param")
    local = _piece(g, layout.blocks[layout.rank]).contiguous()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
    )


def _mine(t: torch.Tensor, ref: torch.Tensor, layout: Any) -> bool:
    """This rank's piece of ``t`` equals the same indices of the one-process ``ref``, bitwise.
    (Local, with no collective: FSDP2 may hold an empty piece as (0, 0), which full_tensor trips on.)"""
    local = t.to_local() if isinstance(t, DTensor) else t
    if ref.ndim == 0:  # AdamW's step counter
        return torch.equal(local, ref)
    expected = _piece(ref, layout.blocks[layout.rank])
    if local.numel() == 0 and expected.numel() == 0:
        return True
    return torch.equal(local, expected)


def _compare(model: nn.Module, opt: Muon, ref: nn.Module, ref_opt: Muon) -> list[str]:
    bad = []
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        layout = layout_of(p, n)
        if not _mine(p.detach(), refs[n].detach(), layout):
            bad.append(n)
        for k, v in opt.state[p].items():
            if not _mine(v, ref_opt.state[refs[n]][k], layout):
                bad.append(f"{n}:{k}")
    return bad


def _train(pairs: list[tuple[nn.Module, Muon]], steps: range) -> None:
    """Step each (model, optimizer) with the same full gradients, cut to each model's layout."""
    runs = [(list(m.parameters()), o) for m, o in pairs]
    step_together(runs, model_grads(pairs[0][0], 50), steps, place=cut_like)


def tp_exactness(mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int = 3) -> dict[str, Any]:
    """FSDP x TP / TP / 3-D mesh parameters, stepped with the same full gradients as one process."""
    torch.manual_seed(0)
    ref = MLP()
    model = shard_mlp(copy.deepcopy(ref), mesh_shape, names)
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    _train([(model, opt), (ref, ref_opt)], range(steps))
    placements = {n: str(tuple(getattr(p, "placements", ()))) for n, p in model.named_parameters()}
    return {"bad": _compare(model, opt, ref, ref_opt), "placements": placements}


def blocks_match_dtensor(mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """Our block of every parameter against what DTensor actually put on this rank: the global
    tensor holds its own flat indices, so the local values name the indices this rank holds."""
    torch.manual_seed(0)
    model: nn.Module = MLP()
    for p in model.parameters():
        p.data = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
    model = shard_mlp(model, mesh_shape, names)
    bad = []
    for n, p in model.named_parameters():
        index = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        if isinstance(p, DTensor) and not _mine(p.detach(), index, layout_of(p, n)):
            bad.append(f"{n} {tuple(p.placements)}")
    return bad


def save_mlp(root: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int) -> None:
    """Train an FSDP (or any) layout for ``steps`` steps and save through the checkpoint helpers."""
    torch.manual_seed(0)
    model = shard_mlp(MLP(), mesh_shape, names)
    opt = Muon(split_params(model), lr=0.02)
    _train([(model, opt)], range(steps))
    ckpt.save_checkpoint(root, steps, model, opt)


def resume_mlp(root: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], total: int) -> list[str]:
    """Load on another layout, finish, and compare this rank's pieces with one process, bitwise."""
    torch.manual_seed(1)
    model = shard_mlp(MLP(), mesh_shape, names)
    opt = Muon(split_params(model), lr=0.02)
    info = ckpt.load_checkpoint(root, model, opt)
    assert info is not None
    _train([(model, opt)], range(info["step"], total))
    torch.manual_seed(0)
    ref = MLP()
    ref_opt = Muon(split_params(ref), lr=0.02)
    _train([(ref, ref_opt)], range(total))
    return _compare(model, opt, ref, ref_opt)


def _gap(model: nn.Module, ref: nn.Module, get: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Largest difference between this rank's pieces and the same indices of the reference."""
    out = 0.0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if isinstance(p, DTensor) and dt(get(p)).to_local().numel():
            layout = layout_of(p, n)
            piece = _piece(get(q), layout.blocks[layout.rank])
            out = max(out, float((piece - dt(get(p)).to_local()).abs().max()))
    return out


def train_fsdp_tp(steps: int = 6) -> dict[str, Any]:
    """Real forward and backward on a 2x2 (dp, tp) mesh: each dp rank takes half of the batch,
    FSDP averages gradients over dp, TP splits every matrix; against one process on the batch.
    Widths divide by the TP size here: DTensor's TP forward needs even activation shards."""
    torch.manual_seed(0)
    ref = MLP((16, 32, 16, 32, 16))
    model = shard_mlp(copy.deepcopy(ref), (2, 2), ("dp", "tp"))
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    dp_rank = dist.get_rank() // 2
    losses: list[float] = []
    ref_losses: list[float] = []
    grad_gap = 0.0
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, o, batch, out in (
            (model, opt, x[dp_rank * 4 : dp_rank * 4 + 4], losses),
            (ref, ref_opt, x, ref_losses),
        ):
            o.zero_grad()
            loss = m(batch).square().mean()
            loss.backward()
            out.append(float(loss.detach()))
        if step == 0:
            grad_gap = _gap(model, ref, lambda t: cast(torch.Tensor, t.grad))
        opt.step()
        ref_opt.step()
    gap = _gap(model, ref, lambda t: t.detach())
    return {"losses": losses, "ref_losses": ref_losses, "gap": gap, "grad_gap": grad_gap}
