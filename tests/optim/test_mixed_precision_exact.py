"""Mixed precision, bit for bit.

1. FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the forward and backward
   run in bf16, the gradients come back reduced in fp32 onto fp32 shards. Given those gradients, the
   sharded step equals a one-process Muon on the fp32 model given the same (gathered) gradients,
   parameters and every state entry bitwise; a plain DCP save and load on the same layout
   (``get_state_dict`` + ``dcp.save``) resumes bitwise. tests/optim/test_mixed_precision.py checks the
   helpers' checkpoint and that such a run trains; this file pins the step itself.
2. bf16 parameters without a policy (``model.to(bfloat16)``, then ``fully_shard``): momentum is bf16,
   as torch.optim.Muon keeps it, and a sharded step equals one process bitwise.
3. On one process, bf16 parameters against torch.optim.Muon. Not bitwise, and why: torch's momentum
   is ``lerp`` (computed in fp32, rounded once to bf16) and its update ``add_(O, alpha=-lr)`` (one
   rounding); ours are separate multiplies and adds, each rounded to the buffer's dtype (so a shard
   computes exactly what the full tensor does; docs/design.md), and the scaled update ``lr * O`` is
   rounded to bf16 before it is subtracted. A reference written both ways, with torch's Newton-Schulz
   copied here, is torch.optim.Muon bit for bit one way and muon_dtensor bit for bit the other, so
   that rounding is the whole difference. Only wide and square matrices: for tall ones our Newton-
   Schulz runs the same polynomial from the right (docs/design.md), equal up to bf16 rounding.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.models import Net, fsdp, full, full_state, random_grads, step_together

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
TOTAL, SAVED = 4, 2
LR, WD, MOMENTUM = 0.02, 0.1, 0.95


def test_policy_step_equals_one_process_and_resumes_bitwise(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(policy_run, 2, str(tmp_path), timeout=180)):
        assert r["compute"] == ["torch.bfloat16"], r["compute"]  # the policy really ran in bf16
        assert r["stored"] == ["torch.float32"], r["stored"]  # fp32 shards, gradients and state
        assert r["laid_out"], f"rank {rank}: state not laid out like its parameter"
        assert r["vs_one_process"] == [], f"rank {rank}: differs from one process at {r['vs_one_process']}"
        assert r["resumed"] == [], f"rank {rank}: resumed run differs at {r['resumed']}"


def test_bf16_params_without_policy_step_equals_one_process() -> None:
    for rank, r in enumerate(run_ranks(bf16_run, 2, timeout=120)):
        assert r["momentum"] == ["torch.bfloat16"], r["momentum"]
        assert r["differ"] == [], f"rank {rank}: sharded bf16 step differs at {r['differ']}"


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def _sharded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=POLICY)
    fully_shard(model, mesh=mesh, mp_policy=POLICY)
    return model


def _backward(model: nn.Module, step: int) -> str:
    """One real forward and backward on this rank's batch of counting sequences; the logits' dtype."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    starts, strides = torch.randint(0, 11, (8, 1), generator=gen), torch.randint(1, 3, (8, 1), generator=gen)
    tokens = (starts + strides * torch.arange(8)) % 11
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, 11), tokens[:, 1:].reshape(-1))
    loss.backward()
    return str(logits.dtype)


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]


def _dcp_round_trip(root: str, model: nn.Module, opt: Muon) -> tuple[nn.Module, Muon]:
    """What accelerate and torchtitan do: ``get_state_dict`` + ``dcp.save``; a fresh model and
    optimizer (other seed) take it back through ``dcp.load`` + ``set_state_dict``."""
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    fresh = _sharded(seed=1)
    fresh_opt = Muon(split_params(fresh), lr=LR)
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=root)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    return fresh, fresh_opt


def _stored_dtypes(model: nn.Module, opt: Muon) -> tuple[set[str], bool]:
    """Dtypes of the shards and their state; whether each state tensor is laid out like its shard."""
    dtypes: set[str] = set()
    laid_out = True
    for p in model.parameters():
        state = [v for v in opt.state[p].values() if v.ndim]
        dtypes.update(str(t.dtype) for t in (p, *state))
        laid_out &= all(isinstance(v, DTensor) and v.placements == p.placements for v in state)  # type: ignore[attr-defined]
    return dtypes, laid_out


def policy_run(root: str) -> dict[str, Any]:
    model = _sharded(seed=0)
    torch.manual_seed(0)
    ref = Net()  # the same initial values, fp32, one process
    opt, ref_opt = Muon(split_params(model), lr=LR), Muon(split_params(ref), lr=LR)
    compute: set[str] = set()
    grad_dtypes: set[str] = set()
    resumed: tuple[nn.Module, Muon] | None = None
    for step in range(TOTAL):
        compute.add(_backward(model, step))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad is not None
            grad_dtypes.add(str(p.grad.dtype))
            q.grad = full(p.grad).clone()  # the reduced fp32 gradient, gathered
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        if step + 1 == SAVED:
            resumed = _dcp_round_trip(root, model, opt)
    assert resumed is not None
    for step in range(SAVED, TOTAL):
        _backward(resumed[0], step)
        resumed[1].step()
        resumed[1].zero_grad()
    straight = full_state(model, opt)
    stored, laid_out = _stored_dtypes(model, opt)
    return {
        "compute": sorted(compute),
        "stored": sorted(stored | grad_dtypes),
        "laid_out": laid_out,
        "vs_one_process": _differ(straight, full_state(ref, ref_opt)),
        "resumed": _differ(straight, full_state(*resumed)),
    }


def bf16_run() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16)
    model = fsdp(copy.deepcopy(ref), (dist.get_world_size(),))
    opt, ref_opt = Muon(split_params(model), lr=LR), Muon(split_params(ref), lr=LR)
    shapes = [p.shape for p in ref.parameters()]

    def grads(step: int) -> list[torch.Tensor]:
        return [g.to(torch.bfloat16) for g in random_grads(shapes, 500 + step)]

    step_together([(list(model.parameters()), opt), (list(ref.parameters()), ref_opt)], grads, range(TOTAL))
    muon = [p for group in opt.param_groups if group["algorithm"] == "muon" for p in group["params"]]
    momentum = {str(opt.state[p]["momentum_buffer"].dtype) for p in muon}
    return {"momentum": sorted(momentum), "differ": _differ(full_state(model, opt), full_state(ref, ref_opt))}


# 3. One process: bf16 parameters against torch.optim.Muon.

WIDE = [(24, 37), (64, 64), (64, 64), (3, 16), (16, 96)]  # rows <= cols; two alike share a batch


def _torch_newton_schulz(x: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` (torch/optim/_muon.py), wide inputs."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    ortho = x.bfloat16()
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho


def _reference_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, *, lerp: bool) -> None:
    """One Nesterov Muon step in place: torch's rounding (``lerp``) or ours (single ops)."""
    if lerp:
        buf.lerp_(g, 1 - MOMENTUM)
        x = g.lerp(buf, MOMENTUM)
    else:
        scaled = g.mul(1 - MOMENTUM)
        buf.mul_(MOMENTUM).add_(scaled)
        x = buf.mul(MOMENTUM).add_(scaled)
    ortho = _torch_newton_schulz(x)
    adjusted = LR * math.sqrt(max(1.0, p.shape[0] / p.shape[1]))
    p.mul_(1 - LR * WD)
    if lerp:
        p.add_(ortho, alpha=-adjusted)
    else:
        p.sub_(ortho.to(p.dtype).mul_(adjusted))


def test_bf16_one_process_against_torch_muon() -> None:
    steps = 10
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in WIDE]
    theirs = [nn.Parameter(t.clone()) for t in start]
    ours = [nn.Parameter(t.clone()) for t in start]
    torch_opt, our_opt = torch.optim.Muon(theirs, lr=LR), Muon(ours, lr=LR)
    refs = {
        lerp: ([t.clone() for t in start], [torch.zeros_like(t) for t in start]) for lerp in (True, False)
    }
    for step in range(steps):
        grads = [g.to(torch.bfloat16) for g in random_grads(WIDE, 700 + step)]
        for params, opt in ((theirs, torch_opt), (ours, our_opt)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        for lerp, (tensors, bufs) in refs.items():
            for t, g, buf in zip(tensors, grads, bufs):
                _reference_step(t, g, buf, lerp=lerp)
    for i in range(len(WIDE)):
        mine, torch_buf = (
            our_opt.state[ours[i]]["momentum_buffer"],
            torch_opt.state[theirs[i]]["momentum_buffer"],
        )
        assert mine.dtype == torch_buf.dtype == torch.bfloat16
        # The reference reproduces each optimizer bit for bit, so the rounding above is the difference.
        assert torch.equal(theirs[i].detach(), refs[True][0][i]) and torch.equal(torch_buf, refs[True][1][i])
        assert torch.equal(ours[i].detach(), refs[False][0][i]) and torch.equal(mine, refs[False][1][i])
        # ... and stays at bf16 precision: after 10 steps within 8 bf16 roundings at each tensor's
        # scale (measured: momentum 3.8, parameters 2.2; 66% and 15% of elements differ).
        for a, b in ((ours[i].detach(), theirs[i].detach()), (mine, torch_buf)):
            assert (a.float() - b.float()).abs().max() <= 8 * 2**-8 * b.float().abs().max(), WIDE[i]
