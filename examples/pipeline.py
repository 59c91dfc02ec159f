"""Pipeline parallelism with muon_dtensor: train as stages, crash, resume with the stages merged.

A small transformer language model (named as torchtitan names its models: ``tok_embeddings``,
``layers``, ``norm``, ``output``) is cut into ``--pp`` stages as torchtitan cuts models (the whole
model with the other stages' modules deleted, so parameter names stay the whole model's). Each stage
is ``fully_shard``-ed on its row of a ("pp", "dp") mesh and gets its own
``muon_dtensor.Muon(split_params(part))``; ``torch.distributed.pipelining`` runs the GPipe schedule.
The cut, the schedule, a stage's step and the merged step are ``muon_dtensor.integrations.pipeline``'s.
The data is a generated corpus (no download), the same batch for a step in every run; each dp rank
trains on its share of it. CPU only, gloo. Run from the repository root, with the package installed.

Train 2 stages x 2 FSDP2 shards on 4 ranks, saving every 4 steps, and crash (every rank leaves by
``os._exit``) right after step 8's save::

    torchrun --standalone --nproc_per_node=4 examples/pipeline.py --steps 12 --save-every 4 \\
        --ckpt runs/pipeline --die-at 8

Resume the newest checkpoint with the stages merged: the whole model on 2 ranks, FSDP2 and one Muon,
no pipeline. It steps the same data with the schedule's arithmetic (per dp rank, the micro-batches'
gradients summed, reduced once, then divided by their count), so with as many ranks as the stages had
dp ranks its weights are bitwise those of an uninterrupted run on the stages::

    torchrun --standalone --nproc_per_node=2 examples/pipeline.py --steps 12 --save-every 4 \\
        --ckpt runs/pipeline --resume --merged

Or resume on stages again (drop ``--merged``, 4 ranks). The last line printed reads
``final step S loss L weights <sha256 of every parameter, by name> (N tensors)``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint
from muon_dtensor.demo.data import batch, corpus, tokens
from muon_dtensor.demo.model import Block, ModelConfig
from muon_dtensor.integrations.pipeline import (
    even_prefixes,
    keep_prefixes,
    merged_step,
    pipeline_step,
    stage_schedule,
)

DIE_CODE = 3  # what every rank exits with at --die-at


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=32, help="model width")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (a multiple of --pp)")
    p.add_argument("--heads", type=int, default=2, help="attention heads")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (world size / pp shards each)")
    p.add_argument("--merged", action="store_true", help="the whole model on every rank, no pipeline")
    p.add_argument("--steps", type=int, default=12, help="train until this step")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, all dp ranks together")
    p.add_argument("--micro-batches", type=int, default=2, help="per dp rank and step")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--seed", type=int, default=0, help="model initialization seed")
    p.add_argument("--ckpt", type=Path, default=Path("runs/pipeline"), help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=4, help="also saved at the last step")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    p.add_argument("--die-at", type=int, default=None, help="save at this step, then exit abruptly")
    return p.parse_args(argv)


class PipeLM(nn.Module):
    """A decoder-only transformer whose stages are this module with some children deleted."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.Module | None = nn.LayerNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None else self.output(h)


def whole_model(args: argparse.Namespace) -> PipeLM:
    torch.manual_seed(args.seed)
    return PipeLM(ModelConfig(vocab=64, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq))


def cut(model: PipeLM, stage: int, stages: int) -> PipeLM:
    """Stage ``stage`` of ``stages``: the other stages' blocks, and the embedding or head, deleted."""
    prefixes = even_prefixes(len(model.layers), stages, first=["tok_embeddings"], last=["norm", "output"])
    return cast(PipeLM, keep_prefixes(model, prefixes[stage]))


def shard(model: PipeLM, mesh: DeviceMesh) -> PipeLM:
    """``fully_shard`` each block, then the rest, over a 1-D mesh."""
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def my_share(args: argparse.Namespace, data: torch.Tensor, step: int, mesh: DeviceMesh) -> torch.Tensor:
    """This dp rank's rows of step ``step``'s global batch (``[rows, seq + 1]``)."""
    dp, rank = mesh["dp"].size(), mesh.get_local_rank("dp")
    if args.batch_size % (dp * args.micro_batches):
        raise SystemExit(
            f"error: --batch-size should be a multiple of dp x --micro-batches ({dp} x {args.micro_batches})"
        )
    share = args.batch_size // dp
    return batch(data, step, args.batch_size, args.seq)[rank * share : (rank + 1) * share]


class Stages:
    """This rank's stage: its model part, its Muon and the GPipe schedule."""

    def __init__(self, args: argparse.Namespace) -> None:
        world = dist.get_world_size()
        if world % args.pp or args.layers % args.pp:
            raise SystemExit(
                f"error: world size {world} and --layers {args.layers} should be multiples of --pp"
            )
        self.mesh = init_device_mesh("cpu", (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
        self.stage = self.mesh.get_local_rank("pp")
        self.last = self.stage == args.pp - 1
        self.model = shard(cut(whole_model(args), self.stage, args.pp), self.mesh["dp"])
        self.opt = Muon(split_params(self.model), lr=args.lr)
        self.schedule = stage_schedule(
            self.model, self.stage, args.pp, device=torch.device("cpu"), group=self.mesh.get_group("pp"),
            n_microbatches=args.micro_batches, loss_fn=loss_fn,
        )  # fmt: skip

    def step(self, rows: torch.Tensor) -> torch.Tensor:
        """One optimizer step; returns the mean of the micro-batches' losses (0 off the last stage)."""
        inputs = rows[:, :-1] if self.stage == 0 else None
        loss = pipeline_step(self.schedule, self.opt, inputs, rows[:, 1:] if self.last else None)
        return torch.zeros(()) if loss is None else loss


class Merged:
    """The whole model on every rank (FSDP2 over all of them) and one Muon, stepped as the schedule."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.model = shard(whole_model(args), self.mesh)
        self.opt = Muon(split_params(self.model), lr=args.lr)
        self.micro = args.micro_batches

    def step(self, rows: torch.Tensor) -> torch.Tensor:
        """GPipe's arithmetic (``merged_step``): the micro-batches' gradients reduced once, after the
        last one, as ``PipelineStage`` runs FSDP2, then divided by their count."""
        micro = [(m[:, :-1], m[:, 1:]) for m in rows.chunk(self.micro)]
        return merged_step(self.model, self.opt, micro, loss_fn)


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def mean_loss(loss: torch.Tensor, dp: int) -> float:
    """The step's loss on every rank: the dp ranks' losses summed over the world (0 off the last
    stage), divided by dp."""
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return float(total) / dp


def checksum(model: nn.Module) -> tuple[str, int]:
    """sha256 over every parameter of the whole model (every rank's part), in name order."""
    digests = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p  # collective over the part's dp ranks
        digests[name] = hashlib.sha256(whole.detach().contiguous().numpy().tobytes()).hexdigest()
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    named = {k: v for d in everyone if d for k, v in d.items()}
    text = "".join(f"{k} {named[k]}\n" for k in sorted(named))
    return hashlib.sha256(text.encode()).hexdigest(), len(named)


def resume(args: argparse.Namespace, run: Stages | Merged) -> int:
    """Load the newest checkpoint into this rank's part (any stage layout saved it); its data step."""
    if not args.resume:
        return 0
    info = load_checkpoint(args.ckpt, run.model, run.opt)
    if info is None:
        log(f"--resume: no complete checkpoint under {args.ckpt}, starting from step 0")
        return 0
    log(f"resumed step {info['step']} from {args.ckpt} ({'merged' if args.merged else f'{args.pp} stages'})")
    return int(info["data_step"])


def train(args: argparse.Namespace) -> None:
    run: Stages | Merged = Merged(args) if args.merged else Stages(args)
    dp = run.mesh["dp"].size() if isinstance(run, Stages) else run.mesh.size()
    layout = f"merged, FSDP2 over {dp}" if args.merged else f"{args.pp} stages x {dp} FSDP2 shards, GPipe"
    log(f"{layout}, {sum(p.numel() for p in run.model.parameters()):,} parameters in rank 0's part")
    data, start, loss = tokens(corpus()), resume(args, run), float("nan")
    clock = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        loss = mean_loss(run.step(my_share(args, data, step, run.mesh)), dp)
        log(f"step {step}/{args.steps} loss {loss:.6f}")
        if step % args.save_every == 0 or step in (args.steps, args.die_at):
            save_checkpoint(
                args.ckpt, step, run.model, run.opt, extra={"data_step": step}, keep_last=args.keep_last
            )
            log(f"saved step {step}")
        if step == args.die_at:
            log(f"--die-at {step}: every rank exits now (code {DIE_CODE})")
            sys.stdout.flush()
            os._exit(DIE_CODE)
    log(f"trained steps {start + 1} to {args.steps} in {time.perf_counter() - clock:.1f} s")
    digest, count = checksum(run.model)
    log(f"final step {args.steps} loss {loss!r} weights {digest} ({count} tensors)")


def finish() -> None:
    """Leave once every rank is done, by ``os._exit``: gloo can abort a process at interpreter exit
    after its work is done, and torchrun would report the run as failed (as examples/train.py)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    dist.init_process_group("gloo")
    train(args)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
