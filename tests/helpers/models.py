"""Models and helpers shared by the multi-rank tests: small nets with uneven widths, full tensors, and
one loop that steps several optimizers with the same full gradients."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar, cast

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.optim import Optimizer

from muon_dtensor.base.compat import StridedShard as _StridedShard

Place = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Opt = TypeVar("Opt", bound=Optimizer)


def dt(p: torch.Tensor | None) -> DTensor:
    """``p`` as the DTensor it is: a parameter or gradient over a DTensor is one, which torch's
    types do not say (``nn.Parameter``'s attributes are a plain tensor's)."""
    assert isinstance(p, DTensor), type(p)
    return p


class Net(nn.Module):
    """Uneven widths; 3 and 1 rows give empty shards at 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.layers = nn.ModuleList(
            [nn.Linear(16, 37), nn.Linear(37, 3), nn.Linear(3, 24), nn.Linear(24, 24), nn.Linear(24, 1)]
        )
        self.lm_head = nn.Linear(1, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.lm_head(h)


def fsdp(model: nn.Module, mesh_shape: tuple[int, ...]) -> nn.Module:
    """fully_shard each of ``model.layers``, then the root: FSDP on a 1-D mesh, HSDP on a 2-D one."""
    names = ("dp",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in cast(nn.ModuleList, model.layers):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(mesh_shape: tuple[int, ...] | None, seed: int = 0) -> nn.Module:
    """A ``Net`` from ``seed``, sharded on ``mesh_shape`` or left whole (None: the one-process run)."""
    torch.manual_seed(seed)
    model = Net()
    return model if mesh_shape is None else fsdp(model, mesh_shape)


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


def shard_mlp(model: nn.Module, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> nn.Module:
    """TP over the "tp" mesh axis (if any), then fully_shard over the other axes (if any)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    if "tp" in names:
        plan = {
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
            "w3": ColwiseParallel(),
            "w4": RowwiseParallel(),
        }
        parallelize_module(model, mesh["tp"], plan)
    dp = tuple(n for n in names if n != "tp")
    if dp:
        fully_shard(model, mesh=mesh[dp] if len(dp) > 1 else mesh[dp[0]])
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank for a DTensor (a collective), else ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: nn.Module, opt: Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and state entry as a full tensor, keyed by FQN (``"fqn:key"`` for state)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p.detach())
        out.update({f"{name}:{k}": full(v) for k, v in opt.state[p].items()})
    return out


def distribute_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A full gradient ``g``, the same on every rank, laid out like the parameter ``p``: each rank
    keeps its own piece (``src_data_rank=None``, no scatter from rank 0); through a replicated copy
    where ``p`` has a ``_StridedShard`` (FSDP over an EP or TP shard of dim 0), which
    ``distribute_tensor`` refuses."""
    if not isinstance(p, DTensor):
        return g
    mesh = p.device_mesh
    if not any(isinstance(q, _StridedShard) for q in p.placements):
        return distribute_tensor(g, mesh, p.placements, src_data_rank=None)
    whole = distribute_tensor(g, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)
    return whole.redistribute(mesh, p.placements)


def random_grads(shapes: Sequence[torch.Size | tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def step_together(
    runs: Sequence[tuple[Sequence[torch.Tensor], Optimizer]],
    grads: Callable[[int], Sequence[torch.Tensor]],
    steps: Iterable[int],
    place: Place = distribute_like,
) -> None:
    """Step every (parameters, optimizer) pair with the same full gradients ``grads(step)``, one per
    parameter, each laid out like its parameter by ``place``."""
    for step in steps:
        full_grads = grads(step)
        for params, opt in runs:
            for p, g in zip(params, full_grads, strict=True):
                p.grad = place(p, g.clone())
            opt.step()


def stepped(
    shapes: Sequence[tuple[int, ...]],
    mesh_shape: tuple[int, ...] | None,
    placements: Callable[[int], tuple],
    steps: int,
    make_opt: Callable[[list[nn.Parameter]], Opt],
) -> tuple[list[nn.Parameter], Opt]:
    """Seeded parameters of ``shapes`` and ``make_opt``'s optimizer over them after ``steps`` steps
    with the same seeded full gradients: parameter i sharded by ``placements(i)`` on a CPU mesh of
    ``mesh_shape``, or in one process (``None``)."""
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    draws = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape is not None else None
    params = [
        nn.Parameter(f.clone() if mesh is None else distribute_tensor(f.clone(), mesh, placements(i)))
        for i, f in enumerate(fulls)
    ]
    opt = make_opt(params)
    step_together([(params, opt)], lambda step: draws[step], range(steps))
    return params, opt


def model_grads(model: nn.Module, offset: int) -> Callable[[int], list[torch.Tensor]]:
    """Full gradients for ``model``'s parameters at each step, seeded ``offset + step``."""
    shapes = [p.shape for p in model.parameters()]
    return lambda step: random_grads(shapes, offset + step)


def trained_net(seed: int = 0) -> tuple[nn.Module, Optimizer]:
    """A Net and its Muon after one step, so weights and momentum are not the initial ones."""
    from muon_dtensor import Muon, split_params

    torch.manual_seed(seed)
    model = Net()
    opt = Muon(split_params(model), lr=0.02)
    model(torch.arange(6).reshape(2, 3)).square().mean().backward()
    opt.step()
    return model, opt


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the model's state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
