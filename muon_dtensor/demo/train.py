"""The demo's rank function: train a TinyLM, save a checkpoint, crash, resume, on any world size.

``train(spec)`` runs on every rank (``muon_dtensor.testing.run_ranks``). Two sessions share the loop:
``ShardedSession`` (FSDP2 + ``muon_dtensor.Muon`` + ``save_checkpoint``) and the round-robin double
(``round_robin.RoundRobinSession``).

Every step's global batch is the same list of micro-batches on any world size; each data-parallel
rank takes its share and accumulates their gradients. A micro-batch's gradient then does not depend
on the world size, which is what makes a resumed run on another world size comparable.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint

from .data import corpus, micro_batches, tokens
from .log import grad_norm, log_line
from .model import ModelConfig, TinyLM
from .parallel import build_mesh, data_parallel, demo_shape, device_type, shard_model
from .qk_clip import StepClip
from .round_robin import RoundRobinSession

__all__ = ["ADAMW", "ADAMW_NAMES", "LR", "WEIGHT_DECAY", "RunSpec", "ShardedSession", "train"]

LR, WEIGHT_DECAY = 0.02, 0.1  # Muon
ADAMW: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.0}  # embeddings, positions, norms, head
# ``pos`` is a 2-D parameter but an embedding table (not an nn.Embedding): AdamW, not Muon.
ADAMW_NAMES = ("pos",)
CRASHED = "CRASHED"  # marker file a crashing run leaves in its checkpoint folder


@dataclass(frozen=True)
class RunSpec:
    optimizer: str  # "muon_dtensor" or "round_robin"
    layout: str  # "fsdp", "hsdp" or "fsdp-tp" (muon_dtensor only)
    steps: int  # train up to and including this step
    micro_batches: int  # the global batch is this many micro-batches...
    micro_size: int  # ...of this many sequences
    folder: str  # checkpoint folder
    save_at: int | None = None
    crash_at: int | None = None  # SIGKILL every rank after this step
    resume: bool = False
    record_from: int | None = None  # keep every parameter (full) after each step >= this
    progress: str | None = None  # rank 0 writes "step total" here after each step
    ns_dtype: str = "bfloat16"  # Newton-Schulz dtype; "float32" where bf16 is emulated (demo/cpu.py)
    normuon: bool = False  # --normuon: NorMuon in the Muon groups (muon_dtensor only)
    model: ModelConfig = field(default_factory=ModelConfig)
    qk_clip: float | None = None  # QK-Clip threshold after every step (``--qk-clip``), or None
    log_every: int | None = None  # rank 0 logs a line (``log.log_line``) every this many steps


class ShardedSession:
    """FSDP2-sharded TinyLM with one ``muon_dtensor.Muon`` (Muon + AdamW groups) and DCP checkpoints."""

    sums_gradients = False  # FSDP averages gradients over data-parallel ranks

    def __init__(
        self, model: nn.Module, layout: str, ns_dtype: str = "bfloat16", normuon: bool = False
    ) -> None:
        mesh = build_mesh(demo_shape(layout, dist.get_world_size()))
        shard_model(model, mesh)
        self.model = model
        groups = split_params(model, adamw=ADAMW_NAMES, adamw_options=ADAMW)
        for group in groups:
            if group["algorithm"] == "muon":
                group["normuon"] = normuon
        self.opt = Muon(
            groups,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            ns_dtype=ns_dtype,
        )
        self.dp_rank, self.dp_size, self.dp_group = data_parallel(mesh)

    def update(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def save(self, root: str, step: int) -> Path:
        return save_checkpoint(root, step, self.model, self.opt, extra={"data_step": step})

    def load(self, root: str) -> int:
        info = load_checkpoint(root, self.model, self.opt)
        if info is None:
            raise FileNotFoundError(f"no complete checkpoint under {root}")
        return int(info["data_step"])

    def momentum_kept(self) -> tuple[int, int]:
        """(momentum buffers holding data, Muon matrices)."""
        muon = [p for g in self.opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        kept = sum(bool(_full(self.opt.state[p]["momentum_buffer"]).any()) for p in muon)
        return kept, len(muon)

    def full_params(self) -> dict[str, torch.Tensor]:
        # clone: on one rank full_tensor() may be the parameter's own storage
        return {n: _full(p).cpu().clone() for n, p in self.model.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _session(spec: RunSpec) -> ShardedSession | RoundRobinSession:
    torch.manual_seed(0)
    model = TinyLM(spec.model).to(device_type())
    if spec.optimizer == "round_robin":
        return RoundRobinSession(
            model,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            adamw=ADAMW,
            adamw_names=ADAMW_NAMES,
            ns_dtype=spec.ns_dtype,
        )
    return ShardedSession(model, spec.layout, spec.ns_dtype, spec.normuon)


def my_micro_batches(
    session: ShardedSession | RoundRobinSession, data: torch.Tensor, step: int, spec: RunSpec
) -> list[torch.Tensor]:
    """This data-parallel rank's share of the step's micro-batches, on the device."""
    micros = micro_batches(data, step, spec.micro_batches, spec.micro_size, spec.model.seq)
    share = spec.micro_batches // session.dp_size
    mine = micros[session.dp_rank * share : (session.dp_rank + 1) * share]
    return [m.to(device_type()) for m in mine]


def train_step(
    session: ShardedSession | RoundRobinSession,
    data: torch.Tensor,
    step: int,
    spec: RunSpec,
    norms: dict[int, float] | None = None,
) -> float:
    """One optimizer step on this rank's share of the micro-batches; returns the global mean loss.
    With ``norms``: the global gradient norm before the step in ``norms[step]`` (collective)."""
    # Both sessions end with the sum over all micro-batches of grad / micro_batches (FSDP divides by
    # the data-parallel size itself; with power-of-two sizes every scaling is exact).
    scale = (1 if session.sums_gradients else session.dp_size) / spec.micro_batches
    losses = []
    for tokens_ in my_micro_batches(session, data, step, spec):
        loss = session.model.loss(tokens_)  # type: ignore[operator]
        (loss * scale).backward()
        losses.append(loss.detach().float().cpu())
    if norms is not None:
        norms[step] = grad_norm(session.model.parameters())
    session.update()
    mine = torch.stack(losses)
    everyone = [torch.empty_like(mine) for _ in range(session.dp_size)]
    dist.all_gather(everyone, mine, group=session.dp_group)
    return float(torch.cat(everyone).sum() / spec.micro_batches)


def _crash(folder: str, step: int) -> None:
    """SIGKILL this rank, once every rank is past its last collective (a file handshake, so no rank
    dies while another still waits on it in gloo)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    Path(folder, f".ready{rank}").touch()
    while not all(Path(folder, f".ready{r}").exists() for r in range(world)):
        time.sleep(0.01)
    if rank == 0:
        Path(folder, CRASHED).write_text(str(step))
    os.kill(os.getpid(), signal.SIGKILL)


def _progress(path: str | None, step: int, total: int) -> None:
    if path and dist.get_rank() == 0:
        Path(path + ".part").write_text(f"{step} {total}")
        os.replace(path + ".part", path)


def _logs(spec: RunSpec, step: int, start: int) -> bool:
    """A logging step (muon_dtensor's sessions only): the first after the start, every
    ``log_every``-th, the last."""
    every = spec.log_every
    return every is not None and every > 0 and (step == start + 1 or step % every == 0 or step == spec.steps)


def _tokens(spec: RunSpec) -> int:
    return spec.micro_batches * spec.micro_size * spec.model.seq  # the global batch's tokens


def _log(
    session: ShardedSession,
    spec: RunSpec,
    step: int,
    out: dict[str, Any],
    norm: float,
    rate: float,
) -> None:
    """Rank 0: the log line into ``out["log"]`` and, for the parent's progress bar, ``<progress>.log``."""
    if dist.get_rank() != 0:
        return
    line = log_line(step, spec.steps, out["losses"][step], rate, norm, session.opt, device_type())
    out.setdefault("log", []).append(line)
    if spec.progress:
        with open(spec.progress + ".log", "a") as f:
            f.write(line + "\n")


def _record(session: ShardedSession | RoundRobinSession, out: dict[str, Any], step: int) -> None:
    full = session.full_params()  # collective
    if dist.get_rank() == 0:
        out["params"][step] = full


def train(spec: RunSpec) -> dict[str, Any] | None:
    """Rank function. Rank 0 returns losses by step, recorded parameters and checkpoint facts."""
    session = _session(spec)
    Path(spec.folder).mkdir(parents=True, exist_ok=True)
    data = tokens(corpus())
    start = 0
    out: dict[str, Any] = {"losses": {}, "params": {}, "kept": None}
    if spec.resume:
        start = session.load(spec.folder)
        out["kept"] = session.momentum_kept()
    record_from = spec.record_from
    if record_from is not None and record_from <= start:
        _record(session, out, start)
    clip = None if spec.qk_clip is None else StepClip(session.model, spec.qk_clip)
    clock, since = time.perf_counter(), start
    for step in range(start + 1, spec.steps + 1):
        if clip is not None:
            clip.start()
        norms: dict[int, float] | None = (
            {} if isinstance(session, ShardedSession) and _logs(spec, step, start) else None
        )
        out["losses"][step] = train_step(session, data, step, spec, norms)
        if norms is not None and isinstance(session, ShardedSession):
            seconds, clock = time.perf_counter() - clock, time.perf_counter()
            _log(session, spec, step, out, norms[step], (step - since) * _tokens(spec) / seconds)
            since = step
        if clip is not None:
            out.setdefault("qk_clip", {})[step] = clip.finish(my_micro_batches(session, data, step, spec))
        if record_from is not None and step >= record_from:
            _record(session, out, step)
        if step == spec.save_at:
            out["checkpoint"] = str(session.save(spec.folder, step))
        _progress(spec.progress, step, spec.steps)
        if step == spec.crash_at:
            _crash(spec.folder, step)
    return out if dist.get_rank() == 0 else None
