"""Train a transformer language model with muon_dtensor under torchrun.

FSDP2 (or HSDP, or FSDP x TP) sharding, one ``muon_dtensor.Muon`` for hidden matrices and AdamW for
the rest, linear warmup then cosine decay (``LambdaLR``), sharded DCP checkpoints every
``--save-every`` steps, ``--resume`` from the newest complete checkpoint (the step, data position and
schedule come back with it), and a safetensors export of the last checkpoint at the end.

The data is a generated corpus (no download) or any file given with ``--data`` (its bytes are the
tokens). Run from the repository root, with the package installed (``pip install -e .``).

One node, two processes (CPU: gloo; GPUs: NCCL, one per process)::

    torchrun --standalone --nproc_per_node=2 examples/train.py --steps 200 --ckpt runs/train

Resume after a crash (same command plus ``--resume``; any world size): the step, data position and
learning-rate schedule continue exactly::

    torchrun --standalone --nproc_per_node=2 examples/train.py --steps 200 --ckpt runs/train --resume

The checkpoint records the schedule (warmup, horizon ``--steps``, floor); a resume that would change
it is refused. To train longer than planned, say so: ``--stretch-schedule`` rebuilds the cosine to
end at the new ``--steps``, as if the run had been planned that long (the log shows the learning rate
before and after; it goes up)::

    torchrun --standalone --nproc_per_node=2 examples/train.py --steps 400 --ckpt runs/train --resume \\
        --stretch-schedule

Two nodes, one command on each (``--rdzv_endpoint`` is node 0's address; 127.0.0.1 runs both
"nodes" on this machine; ``--ckpt`` must be a folder every node sees)::

    torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:29500 examples/train.py --steps 200 --ckpt runs/train
    torchrun --nnodes 2 --nproc_per_node 1 --node_rank 1 --rdzv_backend c10d \\
        --rdzv_endpoint 127.0.0.1:29500 examples/train.py --steps 200 --ckpt runs/train

Mesh: ``--dp D --tp T`` with ``D x T`` = world size (default: all ranks data-parallel, ``--tp 1``);
``--replicas R`` makes HSDP with ``R`` replica groups of ``D / R`` shards. A bigger model::

    torchrun --standalone --nproc_per_node=4 examples/train.py --dim 256 --layers 4 --heads 8 --dp 2 --tp 2
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import latest_step, load_checkpoint, save_checkpoint
from muon_dtensor.checkpoint.manifest import step_dir
from muon_dtensor.checkpoint.safetensors import export_safetensors
from muon_dtensor.demo.data import batch, corpus, file_tokens, tokens
from muon_dtensor.demo.log import grad_norm, learning_rates, peak_memory
from muon_dtensor.demo.model import ModelConfig, TinyLM
from muon_dtensor.demo.parallel import MeshShape, build_mesh, data_parallel, device_type, shard_model


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in ``--help`` (where its help does not
    already say it, and the option has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action) or text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=64, help="model width")
    model.add_argument("--layers", type=int, default=2, help="transformer blocks")
    model.add_argument("--heads", type=int, default=4, help="attention heads")
    model.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    mesh = p.add_argument_group("mesh")
    mesh.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: world size / tp)")
    mesh.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    mesh.add_argument("--replicas", type=int, default=1, help="HSDP replica groups among the dp ranks")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=200, help="train until this step")
    train.add_argument("--batch-size", type=int, default=16, help="sequences per step, all ranks together")
    train.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    train.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate")
    train.add_argument("--weight-decay", type=float, default=0.1, help="Muon weight decay")
    train.add_argument("--warmup", type=int, default=10, help="linear warmup steps")
    train.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction")
    train.add_argument("--data", type=Path, default=None, help="a file to train on (default: generated)")
    train.add_argument("--seed", type=int, default=0, help="model initialization seed")
    train.add_argument("--log-every", type=int, default=10, help="steps between log lines")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--ckpt", type=Path, default=Path("runs/train"), help="checkpoint folder")
    ckpt.add_argument("--save-every", type=int, default=50, help="also saved at the last step")
    ckpt.add_argument("--keep-last", type=int, default=2, help="checkpoints kept (older ones deleted)")
    ckpt.add_argument("--resume", action="store_true", help="start from the newest complete checkpoint")
    ckpt.add_argument(
        "--stretch-schedule",
        action="store_true",
        help="on --resume, accept a --steps, --warmup or --min-lr-ratio that differs from the checkpoint's "
        "schedule: the cosine is rebuilt to end at the new --steps (the learning rate changes at once)",
    )
    ckpt.add_argument(
        "--export", type=Path, default=None, help="safetensors folder (default: CKPT/safetensors)"
    )
    return p.parse_args(argv)


def lr_factor(step: int, *, warmup: int, total: int, floor: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_of(args: argparse.Namespace) -> dict[str, Any]:
    """The learning-rate schedule a checkpoint records next to the scheduler's state."""
    return {"warmup": args.warmup, "horizon": args.steps, "min_lr_ratio": args.min_lr_ratio}


FLAGS = {"warmup": "--warmup", "horizon": "--steps", "min_lr_ratio": "--min-lr-ratio"}


def schedule_problem(saved: dict[str, Any] | None, args: argparse.Namespace) -> str | None:
    """Why resuming with ``args`` would not continue the saved schedule, or None when it would."""
    wanted = schedule_of(args)
    if saved == wanted:
        return None
    if saved is None:
        return "the checkpoint records no learning-rate schedule (saved by an older examples/train.py)"
    changed = ", ".join(
        f"{FLAGS[k]} {saved.get(k)} -> {wanted[k]}" for k in wanted if saved.get(k) != wanted[k]
    )
    return f"the checkpoint's learning-rate schedule differs from this run's ({changed})"


def _continue_with(saved: dict[str, Any] | None) -> str:
    if saved is None:
        return "Start a new run (another --ckpt)"
    return "Resume with " + " ".join(f"{FLAGS[k]} {saved[k]}" for k in FLAGS if k in saved)


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def setup() -> None:
    """Join the job torchrun started (its environment holds rank, world size and rendezvous)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")


def build(args: argparse.Namespace) -> tuple[nn.Module, Muon, Any, torch.Tensor]:
    """Model, optimizer and data; raises SystemExit with a sentence for a mesh that cannot be built."""
    world = dist.get_world_size()
    shape = MeshShape(
        dp=args.dp or world // args.tp, tp=args.tp, replicas=args.replicas, hsdp=args.replicas > 1
    )
    try:
        mesh = build_mesh(shape)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    data = file_tokens(args.data) if args.data else tokens(corpus())
    cfg = ModelConfig(
        vocab=256 if args.data else 64, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq
    )
    torch.manual_seed(args.seed)
    model = TinyLM(cfg).to(device_type())
    shard_model(model, mesh)
    groups = split_params(model, adamw=["pos"], adamw_options={"lr": args.adamw_lr, "weight_decay": 0.0})
    opt = Muon(groups, lr=args.lr, weight_decay=args.weight_decay)
    log(
        f"{shape.describe()}, {sum(p.numel() for p in model.parameters()):,} parameters, {data.numel():,} tokens"
    )
    return model, opt, mesh, data


def train_step(
    model: nn.Module,
    opt: Muon,
    data: torch.Tensor,
    step: int,
    args: argparse.Namespace,
    mesh: Any,
    norm: bool = False,
) -> tuple[float, float | None]:
    """One step on this rank's share of the global batch; returns the mean loss over all ranks and,
    with ``norm`` (logging steps only: one all-reduce per mesh), the global gradient norm before it."""
    dp_rank, dp_size, dp_group = data_parallel(mesh)
    if args.batch_size % dp_size:
        raise SystemExit(
            f"error: --batch-size should be a multiple of dp ({dp_size}) but is {args.batch_size}"
        )
    share = args.batch_size // dp_size
    mine = batch(data, step, args.batch_size, args.seq)[dp_rank * share : (dp_rank + 1) * share]
    loss = model.loss(mine.to(device_type()))  # type: ignore[operator]
    loss.backward()
    grad = grad_norm(model.parameters()) if norm else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().float()
    dist.all_reduce(total, group=dp_group)
    return float(total) / dp_size, grad


def resume(args: argparse.Namespace, model: nn.Module, opt: Muon, schedule: LambdaLR) -> int:
    """Load the newest complete checkpoint; returns its step (0 when there is none). The schedule
    continues exactly; a changed one is refused unless ``--stretch-schedule`` (SystemExit)."""
    if not args.resume:
        return 0
    info = load_checkpoint(args.ckpt, model, opt)
    if info is None:
        log(f"--resume: no complete checkpoint under {args.ckpt}, starting from step 0")
        return 0
    problem = schedule_problem(info.get("schedule"), args)
    if problem and not args.stretch_schedule:
        raise SystemExit(
            f"error: {problem}: resuming would rebuild the cosine and change the learning rate at once. "
            f"{_continue_with(info.get('schedule'))} to continue exactly, or add --stretch-schedule to "
            "rebuild the schedule for this run's values."
        )
    schedule.load_state_dict(info["scheduler"])
    if problem:
        before = [group["lr"] for group in opt.param_groups]
        for group, base, factor in zip(opt.param_groups, schedule.base_lrs, schedule.lr_lambdas):
            group["lr"] = base * factor(schedule.last_epoch)
        schedule._last_lr = [group["lr"] for group in opt.param_groups]  # what get_last_lr() reports
        log(f"--stretch-schedule: {problem}; lr {before[0]:.5f} -> {opt.param_groups[0]['lr']:.5f}")
    log(f"resumed from {step_dir(args.ckpt, info['step'])} (data position {info['data_step']})")
    return int(info["data_step"])


def train(args: argparse.Namespace) -> None:
    model, opt, mesh, data = build(args)
    factor = lambda step: lr_factor(step, warmup=args.warmup, total=args.steps, floor=args.min_lr_ratio)  # noqa: E731
    schedule = LambdaLR(opt, factor)
    start = resume(args, model, opt, schedule)
    if start >= args.steps:
        finished(start, args)
        return
    clock = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        lr, lrs = opt.param_groups[0]["lr"], learning_rates(opt)  # the learning rates this step uses
        logs = step % args.log_every == 0 or step == args.steps
        loss, norm = train_step(model, opt, data, step, args, mesh, norm=logs)
        schedule.step()
        if logs:
            rate = (step - start) / (time.perf_counter() - clock)
            m = opt.metrics()  # flat floats: what a trainer hands to wandb or TensorBoard as is
            log(
                f"step {step}/{args.steps} loss {loss:.4f} lr {lr:.5f} ({rate:.1f} steps/s, "
                f"{rate * args.batch_size * args.seq:,.0f} tok/s) grad norm {norm:.4g} lr per group {lrs} "
                f"update rms {m['muon/update_rms']:.2e} sent {m['muon/bytes_sent'] / 1e6:.2f} MB "
                f"Newton-Schulz {m['muon/orthogonalized']:.0f} matrices, {peak_memory(device_type())}"
            )
        if step % args.save_every == 0 or step == args.steps:
            extra = {"data_step": step, "scheduler": schedule.state_dict(), "schedule": schedule_of(args)}
            folder = save_checkpoint(args.ckpt, step, model, opt, extra=extra, keep_last=args.keep_last)
            log(f"saved {folder}")


def finished(start: int, args: argparse.Namespace) -> None:
    """A resume at or past ``--steps`` trains nothing: say so (past it, refuse: SystemExit)."""
    if start > args.steps:
        raise SystemExit(
            f"error: the checkpoint is at step {start}, past --steps {args.steps}: nothing to train. "
            f"Give --steps above {start} (with --stretch-schedule) to train on"
        )
    log(
        f"the run is finished: the checkpoint is at step {start} = --steps; nothing to train. To train "
        f"longer, give a larger --steps with --stretch-schedule (the cosine is rebuilt to end there)"
    )


def export(args: argparse.Namespace) -> None:
    """Rank 0 writes the last checkpoint's weights as safetensors (offline: reads the DCP files)."""
    step = latest_step(args.ckpt)
    if dist.get_rank() == 0 and step is not None:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: here that is the intent
            warnings.simplefilter("ignore", UserWarning)
            files = export_safetensors(step_dir(args.ckpt, step), args.export or args.ckpt / "safetensors")
        print(f"exported {', '.join(str(f) for f in files)}", flush=True)
    dist.barrier()


def finish() -> None:
    """Leave once every rank is done. On CPU, leave by ``os._exit``: gloo can abort a process at
    interpreter exit ("terminate called without an active exception") after all its work is done,
    and torchrun would report that node as failed (muon_dtensor/launch.py does the same)."""
    dist.barrier()
    if torch.cuda.is_available():
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup()
    train(args)
    export(args)
    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
