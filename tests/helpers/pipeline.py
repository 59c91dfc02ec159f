"""Pipeline parallelism on CPU: a small model split in two stages as torchtitan splits its models
(the full model with the other stage's modules removed, so names stay the full model's), each stage
``fully_shard``-ed on its own ranks of a ("pp", "dp") mesh, driven by ``torch.distributed.pipelining``.
Shared by tests/optim/test_pipeline.py and tests/checkpoint/test_pipeline_checkpoint.py."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from muon_dtensor import Muon, split_params
from tests.helpers.models import full

VOCAB, WIDTHS, SEQ, BATCH, MICRO = 7, (8, 13, 1, 11, 8), 5, 4, 2
STAGE_LAYERS = (("0", "1"), ("2", "3"))  # layers.2 has one row: an empty shard on a dp rank


class Stack(nn.Module):
    """embed (AdamW), four Linear layers (Muon weights, AdamW biases), norm and output (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(VOCAB, WIDTHS[0])
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTHS[i], WIDTHS[i + 1]) for i in range(4)})
        self.norm: nn.Module | None = nn.LayerNorm(WIDTHS[-1])
        self.output: nn.Module | None = nn.Linear(WIDTHS[-1], VOCAB, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)


def stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


def part(model: Stack, stage: int) -> Stack:
    """Stage ``stage``'s part of ``model`` (a copy): the other stage's modules removed."""
    out = copy.deepcopy(model)
    for key in [k for k in out.layers if k not in STAGE_LAYERS[stage]]:
        del out.layers[key]
    if stage == 0:
        out.norm = out.output = None
    else:
        out.embed = None
    return out


def shard(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """fully_shard each layer, then the root, on a 1-D mesh."""
    for layer in model.layers.values():  # type: ignore[operator]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same tokens and targets on every rank (both dp ranks of a stage see the whole batch, so
    FSDP's mean over 2 ranks of equal gradients is exact)."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=gen)
    return data[0], data[1]


class Pipeline:
    """This rank's stage of a 2 x 2 ("pp", "dp") mesh: its model part, Muon and GPipe schedule."""

    def __init__(self, seed: int = 0, make_opt: Callable[[nn.Module], Muon] | None = None) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        self.mesh = mesh
        self.stage = mesh.get_local_rank("pp")
        self.model = shard(part(stack(seed), self.stage), mesh["dp"])
        self.opt = (make_opt or muon)(self.model)
        pipe = PipelineStage(self.model, self.stage, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        self.schedule = ScheduleGPipe(pipe, n_microbatches=MICRO, loss_fn=loss_fn)

    def backward(self, step: int) -> None:
        tokens, targets = batch(step)
        if self.stage == 0:
            self.schedule.step(tokens)
        else:
            self.schedule.step(target=targets)

    def train(self, steps: range) -> None:
        for step in steps:
            self.opt.zero_grad(set_to_none=True)
            self.backward(step)
            self.opt.step()


def muon(model: nn.Module) -> Muon:
    return Muon(split_params(model), lr=0.02)


def reference_backward(model: nn.Module, step: int) -> None:
    """One process: the schedule's arithmetic (gradients summed over micro-batches, then divided by
    their count)."""
    tokens, targets = batch(step)
    for x, y in zip(tokens.chunk(MICRO), targets.chunk(MICRO)):
        loss_fn(model(x), y).backward()
    for p in model.parameters():
        assert p.grad is not None
        p.grad.div_(MICRO)


def reference_train(model: nn.Module, opt: Muon, steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        reference_backward(model, step)
        opt.step()


def snapshot(model: nn.Module, opt: Muon) -> dict[str, torch.Tensor]:
    """Every parameter and state entry as a full tensor, keyed by FQN (``"fqn:key"`` for state)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p.detach()).clone()
        out.update({f"{name}:{k}": full(v).clone() for k, v in opt.state[p].items()})
    return out


def differences(mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    """Keys of ``mine`` whose tensors differ from ``ref``'s in any bit (or are missing there)."""
    return [k for k, v in mine.items() if k not in ref or not torch.equal(v, ref[k])]


def stage_ranks() -> list[int]:
    """The ranks of this rank's stage (the pp mesh puts stage s on ranks 2s and 2s + 1)."""
    first = 2 * (dist.get_rank() // 2)
    return [first, first + 1]
