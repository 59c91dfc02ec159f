"""Rank functions for tensor parallel, FSDP x TP, 3-D meshes, DDP, experts, conv and fused weights."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from muon_dtensor import Muon, split_params
from muon_dtensor._sharding.param_layout import layout_of as describe


class MLP(nn.Module):
    """Uneven widths so TP and FSDP pieces are uneven; ``w3`` has fewer rows than ranks."""

    def __init__(self, widths: tuple[int, ...] = (16, 38, 20, 3, 16)) -> None:
        super().__init__()
        self.w1 = nn.Linear(widths[0], widths[1], bias=False)  # colwise
        self.w2 = nn.Linear(widths[1], widths[2], bias=False)  # rowwise
        self.w3 = nn.Linear(widths[2], widths[3], bias=False)  # colwise
        self.w4 = nn.Linear(widths[3], widths[4], bias=False)  # rowwise
        self.norm = nn.LayerNorm(widths[4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.w1, self.w2, self.w3, self.w4):
            x = torch.tanh(layer(x))
        return self.norm(x)


PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel(), "w4": RowwiseParallel()}


def _shard(model: nn.Module, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> nn.Module:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], PLAN)
    dp = tuple(n for n in names if n != "tp")
    if dp:
        fully_shard(model, mesh=mesh[dp] if len(dp) > 1 else mesh[dp[0]])
    return model


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _piece(full: torch.Tensor, block) -> torch.Tensor:
    for d, intervals in enumerate(block):
        full = full.index_select(d, torch.cat([torch.arange(a, b) for a, b in intervals]))
    return full


def _set(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Gradients cut from full tensors by our blocks (distribute_tensor refuses uneven strided
    shards); blocks_match_dtensor checks those blocks against DTensor's own placement."""
    for n, p in model.named_parameters():
        g = grads[n].clone()
        if isinstance(p, DTensor):
            layout = describe(p, n)
            local = _piece(g, layout.blocks[layout.rank]).contiguous()
            g = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        p.grad = g


def _mine(t: torch.Tensor, ref: torch.Tensor, layout) -> bool:
    """This rank's piece of ``t`` equals the same indices of the one-process ``ref``, bitwise.
    (Local, with no collective: FSDP2 may hold an empty piece as (0, 0), which full_tensor trips on.)"""
    local = t.to_local() if isinstance(t, DTensor) else t
    if ref.ndim == 0:  # AdamW's step counter
        return torch.equal(local, ref)
    expected = _piece(ref, layout.blocks[layout.rank])
    if local.numel() == 0 and expected.numel() == 0:
        return True
    return torch.equal(local, expected)


def _compare(model, opt, ref, ref_opt) -> list[str]:
    bad = []
    refs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        layout = describe(p, n)
        if not _mine(p.detach(), refs[n].detach(), layout):
            bad.append(n)
        for k, v in opt.state[p].items():
            if not _mine(v, ref_opt.state[refs[n]][k], layout):
                bad.append(f"{n}:{k}")
    return bad


def tp_exactness(mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int = 3) -> dict[str, Any]:
    """FSDP x TP / TP / 3-D mesh parameters, stepped with the same full gradients as one process."""
    torch.manual_seed(0)
    ref = MLP()
    model = _shard(copy.deepcopy(ref), mesh_shape, names)
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    for step in range(steps):
        grads = _grads(ref, step)
        _set(model, grads)
        _set(ref, grads)
        opt.step()
        ref_opt.step()
    placements = {n: str(tuple(getattr(p, "placements", ()))) for n, p in model.named_parameters()}
    return {"bad": _compare(model, opt, ref, ref_opt), "placements": placements}


def blocks_match_dtensor(mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """Our block of every parameter against what DTensor actually put on this rank: the global
    tensor holds its own flat indices, so the local values name the indices this rank holds."""
    torch.manual_seed(0)
    model = MLP()
    for p in model.parameters():
        p.data = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
    model = _shard(model, mesh_shape, names)
    bad = []
    for n, p in model.named_parameters():
        index = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        if isinstance(p, DTensor) and not _mine(p.detach(), index, describe(p, n)):
            bad.append(f"{n} {tuple(p.placements)}")
    return bad


def _train_mlp(model: nn.Module, opt: Muon, steps: range) -> None:
    for step in steps:
        _set(model, _grads(model, step))
        opt.step()


def save_mlp(root: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int) -> None:
    """Train an FSDP (or any) layout for ``steps`` steps and save through the checkpoint helpers."""
    import muon_dtensor.checkpoint as ckpt

    torch.manual_seed(0)
    model = _shard(MLP(), mesh_shape, names)
    opt = Muon(split_params(model), lr=0.02)
    _train_mlp(model, opt, range(steps))
    ckpt.save_checkpoint(root, steps, model, opt)


def resume_mlp(root: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], total: int) -> list[str]:
    """Load on another layout, finish, and compare this rank's pieces with one process, bitwise."""
    import muon_dtensor.checkpoint as ckpt

    torch.manual_seed(1)
    model = _shard(MLP(), mesh_shape, names)
    opt = Muon(split_params(model), lr=0.02)
    step = ckpt.load_checkpoint(root, model, opt)["step"]
    _train_mlp(model, opt, range(step, total))
    torch.manual_seed(0)
    ref = MLP()
    ref_opt = Muon(split_params(ref), lr=0.02)
    _train_mlp(ref, ref_opt, range(total))
    return _compare(model, opt, ref, ref_opt)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def train_fsdp_tp(steps: int = 6) -> dict[str, Any]:
    """Real forward and backward on a 2x2 (dp, tp) mesh: each dp rank takes half of the batch,
    FSDP averages gradients over dp, TP splits every matrix; against one process on the batch.
    Widths divide by the TP size here: DTensor's TP forward needs even activation shards."""
    torch.manual_seed(0)
    ref = MLP((16, 32, 16, 32, 16))
    model = _shard(copy.deepcopy(ref), (2, 2), ("dp", "tp"))
    opt, ref_opt = Muon(split_params(model), lr=0.02), Muon(split_params(ref), lr=0.02)
    dp_rank = dist.get_rank() // 2
    losses, ref_losses, grad_gap = [], [], 0.0
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, o, batch, out in (
            (model, opt, x[dp_rank * 4 : dp_rank * 4 + 4], losses),
            (ref, ref_opt, x, ref_losses),
        ):
            o.zero_grad()
            loss = _loss(m, batch)
            loss.backward()
            out.append(float(loss.detach()))
        if step == 0:
            grad_gap = _gap(model, ref, lambda t: t.grad)
        opt.step()
        ref_opt.step()
    gap = _gap(model, ref, lambda t: t.detach())
    return {"losses": losses, "ref_losses": ref_losses, "gap": gap, "grad_gap": grad_gap}


def _gap(model: nn.Module, ref: nn.Module, get) -> float:
    """Largest difference between this rank's pieces and the same indices of the reference."""
    out = 0.0
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if isinstance(p, DTensor) and get(p).to_local().numel():
            layout = describe(p, n)
            piece = _piece(get(q), layout.blocks[layout.rank])
            out = max(out, float((piece - get(p).to_local()).abs().max()))
    return out
