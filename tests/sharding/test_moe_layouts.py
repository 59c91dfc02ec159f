"""Mixture-of-experts layouts under one Muon, as the big runs lay them out: expert stacks ``[E, m, n]``
(torchtitan's grouped-GEMM weights: ``w1``/``w3`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``) on
a 2-D (ep, fsdp) mesh, Shard(0) over experts and Shard(1) over FSDP, beside the dense layers, the
shared expert and the router FSDP-sharded over all 4 ranks. Each step equals one process bit for bit,
each expert is orthogonalized once in the world, and a checkpoint resumes bitwise on another EP
degree (ep 2 -> ep 4, ep 2 -> no EP: the experts on FSDP over all 4 ranks)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from tests.harness import background
from tests.helpers.named_params import AsModule, saved_and_final, snapshot, train

E, DIM, HIDDEN = 4, 8, 12
SPLIT, TOTAL = 2, 3
EXPERTS = ("w1", "w2", "w3")
TIMEOUT = 120.0


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "dense": (DIM, DIM), "shared": (HIDDEN, DIM), "router": (E, DIM),
        "w1": (E, HIDDEN, DIM), "w2": (E, DIM, HIDDEN), "w3": (E, HIDDEN, DIM), "norm": (DIM,),
    }  # fmt: skip
    return {k: torch.randn(s, generator=gen) / 4 for k, s in shapes.items()}


def _groups(params: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    """Muon for the matrices and the expert stacks (one group each), AdamW for the norm."""
    named = list(params.items())
    return [
        {"params": [(n, p) for n, p in named if n in ("dense", "shared", "router")]},
        {"params": [(n, p) for n, p in named if n in EXPERTS], "experts": True},
        {"params": [(n, p) for n, p in named if n == "norm"], "algorithm": "adamw"},
    ]


def build(ep: int | None, seed: int) -> tuple[dict[str, nn.Parameter], Muon]:
    """The MoE's parameters on this rank: ``ep`` None is one process; else experts on (ep, fsdp)."""
    fulls = _weights(seed)
    if ep is None:
        params = {k: nn.Parameter(v) for k, v in fulls.items()}
    else:
        world = dist.get_world_size()
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        moe = init_device_mesh("cpu", (ep, world // ep), mesh_dim_names=("ep", "fsdp"))
        params = {
            k: nn.Parameter(
                distribute_tensor(v, moe, [Shard(0), Shard(1)])
                if k in EXPERTS
                else distribute_tensor(v, dense, [Shard(0)])
            )
            for k, v in fulls.items()
        }
    return params, Muon(_groups(params), lr=0.02)


@functools.cache
def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return saved_and_final(*build(None, 0), SPLIT, TOTAL)


def test_moe_on_ep_by_fsdp_steps_as_one_process_and_resumes_on_other_ep_degrees(
    moe_on_4_ranks: list[Any],
) -> None:
    saved, final = reference()
    for rank, r in enumerate(moe_on_4_ranks):
        for case in ("ep2", "ep2->ep4", "ep2->no ep"):
            loaded, after = r[case]
            assert [k for k in saved if not torch.equal(loaded[k], saved[k])] == [], (rank, case)
            assert [k for k in final if not torch.equal(after[k], final[k])] == [], (rank, case)
        # each of the 3 stacks' 4 experts and the 3 dense matrices once in the world, per step
        assert r["orthogonalized_in_world"] == TOTAL * (3 * E + 3), r
        # describe() shows each stack as its experts and their layout on the (ep, fsdp) mesh
        layout = "Shard(0) over ep (2), Shard(1) over fsdp (2); experts cut across ranks: exchanged"
        for name, shape in (("w1", "12x8"), ("w2", "8x12"), ("w3", "12x8")):
            assert f"  {name} (group 1): {E} experts of {shape}, {layout}" in r["describe"], r["describe"]


def moe_runs(root: str) -> dict[str, Any]:
    params, opt = build(2, 0)
    train(params, opt, range(SPLIT))
    ckpt.save_checkpoint(root, SPLIT, AsModule(params), opt)
    loaded = snapshot(params, opt)
    train(params, opt, range(SPLIT, TOTAL))
    done = torch.tensor([opt.comm_stats.orthogonalized])
    dist.all_reduce(done)
    out: dict[str, Any] = {"ep2": (loaded, snapshot(params, opt)), "orthogonalized_in_world": int(done)}
    out["describe"] = opt.describe()
    for case, ep in (("ep2->ep4", 4), ("ep2->no ep", 1)):
        params, opt = build(ep, seed=5)
        assert ckpt.load_checkpoint(root, AsModule(params), opt) == {"step": SPLIT}
        loaded = snapshot(params, opt)
        train(params, opt, range(SPLIT, TOTAL))
        out[case] = (loaded, snapshot(params, opt))
    return out


# The ranks' runs, a background job on a pool of its own (tests/harness/background.py, ``apart``).
moe_on_4_ranks = background.apart("moe_on_4_ranks", moe_runs, 4, timeout=TIMEOUT, in_folder=True)
