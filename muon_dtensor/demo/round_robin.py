"""A test double of the popular round-robin distributed Muon, the one with the seed bug.

KellerJordan/Muon's distributed ``Muon`` (muon.py at f90a42b, lines 79-94) gives parameter ``i`` to
rank ``i % world``: that rank alone updates it and alone keeps its momentum buffer, then the
parameters are gathered on every rank. Nothing ever syncs the momentum, so ``optimizer.state_dict()``
on rank 0 holds 1 of every ``world`` momentum buffers; a run resumed from it restarts the others
from zero and silently leaves the uninterrupted trajectory.

``RoundRobinMuon`` reproduces that behaviour (same update: Nesterov momentum, Keller's
Newton-Schulz, ``sqrt(max(1, rows/cols))`` scaling, decoupled weight decay), with a broadcast per
parameter in place of the padded ``all_gather`` (the same result). ``RoundRobinSession`` trains the
demo's model with it the way its users do: a replicated model with all-reduced gradients, AdamW for
the non-matrix parameters, and ``torch.save`` of rank 0's state dicts as the checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muon_dtensor import newton_schulz, resolve_ns_config, split_params

__all__ = ["RoundRobinMuon", "RoundRobinSession"]


class RoundRobinMuon(torch.optim.Optimizer):
    """Round-robin Muon on replicated parameters: parameter ``i`` is updated by rank ``i % world``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_dtype: str = "bfloat16",
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        config = resolve_ns_config("keller", 5, 1e-7)
        self.config = replace(config, dtype=getattr(torch, ns_dtype))

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        world, rank = dist.get_world_size(), dist.get_rank()
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            for i, p in enumerate(group["params"]):
                if i % world == rank:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - beta)
                    update = newton_schulz(p.grad.lerp(buf, beta)[None], self.config)[0]
                    update = update.to(p.dtype) * max(1.0, p.size(-2) / p.size(-1)) ** 0.5
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(update, alpha=-lr)
                dist.broadcast(p, src=i % world)


class RoundRobinSession:
    """The demo's training state under round-robin Muon (the interface of ``train.ShardedSession``)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        adamw: dict[str, Any],
        adamw_names: tuple[str, ...] = (),
        ns_dtype: str = "bfloat16",
    ) -> None:
        self.model = model
        muon_group, adamw_group = split_params(model, adamw=adamw_names)
        self.muon_names = [name for name, _ in muon_group["params"]]
        self.muon = RoundRobinMuon(
            [p for _, p in muon_group["params"]], lr=lr, weight_decay=weight_decay, ns_dtype=ns_dtype
        )
        self.adamw = torch.optim.AdamW([p for _, p in adamw_group["params"]], **adamw)
        self.dp_rank, self.dp_size, self.dp_group = dist.get_rank(), dist.get_world_size(), None
        # Gradients are summed over ranks, so each micro-batch's loss carries 1 / micro-batches.
        self.sums_gradients = True

    def update(self) -> None:
        if self.dp_size > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
        self.muon.step()
        self.adamw.step()
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)

    def save(self, root: str, step: int) -> Path:
        """What users of round-robin Muon do: rank 0 saves its own state dicts."""
        path = Path(root) / f"round_robin_step_{step:08d}.pt"
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {"model": self.model.state_dict(), "muon": self.muon.state_dict()}
            torch.save({**state, "adamw": self.adamw.state_dict(), "step": step}, path)
        dist.barrier()
        return path

    def load(self, root: str) -> int:
        path = sorted(Path(root).glob("round_robin_step_*.pt"))[-1]
        saved = torch.load(path, map_location=next(self.model.parameters()).device)
        self.model.load_state_dict(saved["model"])
        self.muon.load_state_dict(saved["muon"])
        self.adamw.load_state_dict(saved["adamw"])
        return int(saved["step"])

    def momentum_kept(self) -> tuple[int, int]:
        """(momentum buffers present after loading, Muon matrices)."""
        kept = sum("momentum_buffer" in self.muon.state[p] for p in self.muon.param_groups[0]["params"])
        return kept, len(self.muon_names)

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
