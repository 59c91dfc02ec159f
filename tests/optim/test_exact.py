"""A sharded step is the one-process step, bit for bit, on every layout, at world sizes 1, 2, 4."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from muon_dtensor import Muon
from muon_dtensor.numerics import newton_schulz
from tests.harness import background
from tests.harness.ranks import run_ranks
from tests.helpers.models import dt, full, step_together

# Uneven rows and columns, fewer rows than ranks (3 and 1 rows at 4 ranks), tall and wide, and
# several same-shape matrices so owners batch them.
SHAPES = [(37, 24), (37, 24), (24, 37), (3, 16), (1, 8), (64, 64), (64, 64), (64, 64), (16, 96)]
ADAMW_SHAPES = [(37,), (10, 8)]


def test_sharded_step_equals_single_process_in_one_process() -> None:
    _check_exact(run_ranks(exactness, 1, timeout=240), 1)


def test_sharded_step_equals_single_process(exact_on_2_ranks: list[Any]) -> None:
    """2 ranks, on a pool of its own beside the session's tests (``background.apart``)."""
    _check_exact(exact_on_2_ranks, 2)


@pytest.mark.slow
def test_sharded_step_equals_single_process_on_4_ranks(exact_on_4_ranks: list[Any]) -> None:
    """The 4-rank case, on a pool of its own beside the session's tests (``background.apart``)."""
    _check_exact(exact_on_4_ranks, 4)


def _check_exact(results: list[Any], world_size: int) -> None:
    for rank, per_layout in enumerate(results):
        assert per_layout, "no layout was checked"
        for key, r in per_layout.items():
            assert r["params"] == [], f"rank {rank} {key}: parameters differ at {r['params']}"
            assert r["momentum"] == [], f"rank {rank} {key}: momentum differs at {r['momentum']}"
            assert r["state_like_param"], f"rank {rank} {key}: momentum is not laid out like its param"
    if world_size > 1:
        assert results[0]["fsdp/owner/bfloat16"]["sent"] > 0, "owner mode moved no data"
        # small rounds really split the exchange (2 all-to-alls per round and step)
        assert (
            results[0]["fsdp/rounds/bfloat16"]["collectives"]
            > results[0]["fsdp/owner/bfloat16"]["collectives"]
        )


def test_batched_path_equals_single_process() -> None:
    """The CUDA path's batching (what ``MUON_DTENSOR_NS_BATCH=always`` selects, here on CPU): an owner's stacks go
    into Newton-Schulz as views, their results come back as one batched tensor, and runs, own
    blocks and sends span a stack's members. Still the one-process step, bit for bit, where each
    matrix runs the same products on both sides (``exactness_batched`` says how)."""
    _check_batched(run_ranks(exactness_batched, 2, timeout=240))


@pytest.mark.slow
def test_batched_path_equals_single_process_on_4_ranks(batched_on_4_ranks: list[Any]) -> None:
    _check_batched(batched_on_4_ranks)


def _check_batched(results: list[Any]) -> None:
    for rank, per_layout in enumerate(results):
        assert per_layout, "no layout was checked"
        for key, r in per_layout.items():
            assert r["params"] == [] and r["momentum"] == [], f"rank {rank} {key}: {r}"


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def exactness_batched(steps: int = 2) -> dict[str, Any]:
    """``exactness`` for bf16 owner mode (one round and small rounds) with batched Newton-Schulz.
    ``batching`` is patched rather than ``MUON_DTENSOR_NS_BATCH`` set: a pooled rank has gloo
    threads running, and ``setenv`` beside them is undefined behaviour (POSIX); the variable's
    parsing is tested alone.

    An owner batches the subset of a shape's matrices it owns (or runs a lone one as a 2-D call),
    the one process all of them: the batched products would have other batch sizes on the two
    sides, and no torch release promises a matrix the same bits whatever its batch (CONTRIBUTING.md,
    "Bits and tolerances"). So each member of a batch runs here as the 2-D call a lone matrix takes,
    on both sides: the same kernels on the same shapes. What this test holds is the bookkeeping
    around the batch (stacks as views, one batched result, runs and sends spanning its members)."""
    asked: list[str] = []
    lone = newton_schulz.newton_schulz

    def always(device_type: str) -> bool:
        asked.append(device_type)
        return True

    def per_member(x: torch.Tensor, config: Any) -> torch.Tensor:
        return torch.stack([lone(m, config) for m in x.unbind(0)]) if x.ndim == 3 else lone(x, config)

    with (
        mock.patch.object(newton_schulz, "batching", always),
        mock.patch.object(newton_schulz, "newton_schulz", per_member),
    ):
        ref_params, ref_bufs, _ = run_steps(None, (), steps)
        out: dict[str, Any] = {}
        for name, (mesh_shape, placements) in layouts(dist.get_world_size()).items():
            for mode, extra in (("owner", {}), ("rounds", {"max_round_bytes": 6000})):
                params, bufs, _ = run_steps(mesh_shape, placements, steps, **extra)
                out[f"{name}/{mode}"] = {
                    "params": _mismatches(params, [p.detach() for p in ref_params]),
                    "momentum": _mismatches(bufs, ref_bufs),
                }
    out["batched"] = {"params": [], "momentum": [] if asked else ["batching was never asked"]}
    return out


def layouts(world_size: int) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """name -> (mesh shape, placements) for every layout that fits ``world_size``."""
    out: dict[str, tuple[tuple[int, ...], tuple]] = {
        "fsdp": ((world_size,), (Shard(0),)),
        "fsdp_dim1": ((world_size,), (Shard(1),)),
        "replicated": ((world_size,), (Replicate(),)),
    }
    if world_size >= 2:
        out["hsdp"] = ((2, world_size // 2), (Replicate(), Shard(0)))
        out["hsdp_1x"] = ((1, world_size), (Replicate(), Shard(0)))
    return out


def _groups(params: list[nn.Parameter], **muon_kwargs: Any) -> list[dict[str, Any]]:
    n = len(SHAPES)
    return [
        {"params": params[:n], **muon_kwargs},
        {"params": params[n:], "algorithm": "adamw", "lr": 3e-3, "weight_decay": 0.05},
    ]


def _fit(placements: tuple, ndim: int) -> tuple:
    """Shard a 1-D tensor on dim 0 where the layout shards matrices on dim 1."""
    return tuple(Shard(0) if isinstance(p, Shard) and p.dim >= ndim else p for p in placements)


def _tensors(steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial values, then full gradients for each step."""
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES + ADAMW_SHAPES
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return params, grads


def run_steps(
    mesh_shape: tuple[int, ...] | None, placements: tuple, steps: int, **muon_kwargs: Any
) -> tuple[list[nn.Parameter], list[torch.Tensor], Muon]:
    """Parameters, momenta and optimizer after ``steps`` steps, sharded on the layout or (mesh_shape
    None) on plain tensors in one process; every step gets the same full gradients either way."""
    fulls, draws = _tensors(steps)
    if mesh_shape is None:
        params = [nn.Parameter(f.clone()) for f in fulls]
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
        params = [nn.Parameter(distribute_tensor(f.clone(), mesh, _fit(placements, f.ndim))) for f in fulls]
    opt = Muon(_groups(params, **muon_kwargs), lr=0.02)
    step_together([(params, opt)], lambda step: draws[step], range(steps))
    bufs = [opt.state[p]["momentum_buffer"] for p in params[: len(SHAPES)]]
    return params, bufs, opt


def _mismatches(sharded: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> list[int]:
    """Indices whose full tensor differs from the reference in any bit."""
    return [i for i, (d, r) in enumerate(zip(sharded, reference)) if not torch.equal(full(d), r)]


def _modes(ns_dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Step modes to check; "rounds" is owner mode pipelined over many small exchange rounds."""
    if ns_dtype == torch.float32:
        return {"owner": {"mode": "owner"}}
    return {
        "owner": {"mode": "owner"},
        "gather": {"mode": "gather"},
        "rounds": {"mode": "owner", "max_round_bytes": 6000},
    }


def exactness(steps: int = 3) -> dict[str, Any]:
    """For every layout and both modes: indices of parameters / momenta that differ bitwise from the
    one-process step, and whether each local momentum is a DTensor like its parameter."""
    out: dict[str, Any] = {}
    for ns_dtype in (torch.bfloat16, torch.float32):
        ref_params, ref_bufs, _ = run_steps(None, (), steps, ns_dtype=ns_dtype)
        for name, (mesh_shape, placements) in layouts(dist.get_world_size()).items():
            for mode, extra in _modes(ns_dtype).items():
                params, bufs, opt = run_steps(mesh_shape, placements, steps, ns_dtype=ns_dtype, **extra)
                out[f"{name}/{mode}/{str(ns_dtype).removeprefix('torch.')}"] = {
                    "params": _mismatches(params, [p.detach() for p in ref_params]),
                    "momentum": _mismatches(bufs, ref_bufs),
                    "state_like_param": all(
                        isinstance(b, DTensor) and b.placements == dt(p).placements and b.shape == p.shape
                        for b, p in zip(bufs, params)
                    ),
                    "sent": opt.comm_stats.sent,
                    "collectives": opt.comm_stats.collectives,
                }
    return out


# Background jobs on pools of their own (tests/harness/background.py).
exact_on_2_ranks = background.apart("exact_on_2_ranks", exactness, 2, timeout=240)
exact_on_4_ranks = background.apart("exact_on_4_ranks", exactness, 4, timeout=240)
batched_on_4_ranks = background.apart("batched_on_4_ranks", exactness_batched, 4, timeout=240)
