"""The cost model's figures beside a rehearsal (``rehearse.rehearse``): the host ops of this rank's
own plans (``host_ops.step_ops`` and ``view_ops``), and the launch's modelled step with this rank's
bytes and memory in the plans it prices (``launch_check.modelled_step``; an MoE model as its dense and
expert groups, ``experts.moe_predict``). Pure arithmetic over the plans, but for the world's size and
this rank read from the (fake) default group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..optim.optimizer import Muon
from ..planning.costmodel import CURRENT_CPU
from ..planning.experts import ExpertLayout, moe_memory
from ..planning.hardware import Hardware
from ..planning.host_ops import StepShape, butterfly_ops, step_ops, view_ops
from ..planning.plans import rank_memory
from ..planning.shapes import MoEModel
from ..planning.traffic import rank_traffic
from ..sharding.plan.blocks import block_numel, block_shape
from ..sharding.plan.grid import butterfly_steps
from .launch_check import modelled_step

__all__ = ["MODELLED_MEMORY_RANKS", "Launch", "modelled", "predicted_ops"]


def predicted_ops(opt: Muon, skip_ns: bool = False) -> int:
    """``host_ops.step_ops`` of this rank's plans (the cost model's host term, with the CPU's
    elementwise pieces and one Newton-Schulz call per matrix)."""
    total = 0
    for entry in opt._plans.entries.values():
        for domains in entry.domains.values():
            for d in domains:
                rank = entry.sharding.layouts[d.members[0][0]].rank
                params = len({pos for pos, _ in d.members})
                local = sum(block_numel(e.blocks[rank]) for e in d.plan.entries)
                shape = StepShape(
                    muon_params=params,
                    muon_buckets=max(1, -(-local // CURRENT_CPU.bucket_elements)),
                    bucket_elements=CURRENT_CPU.bucket_elements,
                    batched=CURRENT_CPU.batched_ns,
                    cpu_piece=CURRENT_CPU.bucket_elements,  # the CPU's pieces, as this step runs
                    newton_schulz=not skip_ns,
                )
                total += sum(step_ops(d.plan, rank, shape).values()) + _piece_ops(entry.sharding, d, rank)
        total += sum(1 for pos in range(len(entry.sharding.views)) if _assembled(entry.sharding, pos))
    return total + _butterflies(opt)


def _butterflies(opt: Muon) -> int:
    """``host_ops.butterfly_ops`` of the step's checks: one sum per mesh of the parameters (the dense
    matrices' and the experts'), a butterfly of two-rank steps above ``grid.GRID_ABOVE`` ranks."""
    meshes = {id(lay.mesh): lay.mesh for e in opt._plans.entries.values() for lay in e.sharding.layouts}
    ranks = [
        m.mesh.flatten().tolist() if m is not None else list(range(dist.get_world_size()))
        for m in meshes.values()
    ]
    me = dist.get_rank()
    return sum(butterfly_ops(len(butterfly_steps(len(r), r.index(me)))) for r in ranks)


def _assembled(sharding: Any, pos: int) -> bool:
    """Whether parameter ``pos`` is not one whole matrix: its update is assembled in a buffer."""
    return len(sharding.views[pos]) > 1 or len(sharding.layouts[pos].blocks[0]) != 2


def _piece_ops(sharding: Any, domain: Any, rank: int) -> int:
    """``host_ops.view_ops`` of this rank's non-empty pieces of a domain's matrices."""
    ops = 0
    for (pos, view), entry in zip(domain.members, domain.plan.entries):
        if block_numel(entry.blocks[rank]):
            layout = sharding.layouts[pos]
            local = block_shape(layout.blocks[layout.rank])
            ops += view_ops(view.local, local[-2], _assembled(sharding, pos))
    return ops


@dataclass(frozen=True)
class Launch:
    """What the model needs of the launch rehearsed: the world, this rank, the mesh and the options."""

    gpus: int
    rank: int
    hsdp: int
    tp: int
    ep: int | None
    owners: str
    max_round_bytes: int | None


def modelled(
    shapes: Sequence[tuple[int, int]],
    at: Launch,
    moe: MoEModel | None,
    hw: Hardware,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """``Rehearsal``'s modelled fields: the launch's step (``modelled_step``: an MoE model as its dense
    and expert groups), this rank's bytes in the plans it prices, and its memory where modelled."""
    ns = {k: options[k] for k in ("ns_steps", "ns_algorithm") if k in options}
    step = modelled_step(
        list(shapes), at.gpus, hsdp=at.hsdp, hw=hw, owners=at.owners, max_round_bytes=at.max_round_bytes,
        moe=moe, ep=at.ep, **ns,
    )  # fmt: skip
    if moe is not None and at.hsdp == 1:
        return {
            "prediction": step,
            "modelled_bytes": _moe_rank_bytes(moe, at),
            "modelled_memory": _moe_memory(moe, at),
        }
    shard, limit = at.gpus // at.hsdp, at.max_round_bytes
    return {
        "prediction": step,
        "modelled_bytes": _rank_bytes(list(shapes), shard, at.rank, at.hsdp, step.owners, limit),
        "modelled_memory": _modelled_memory(list(shapes), shard // at.tp, at.hsdp, at.tp, at.rank, limit),
    }


def _moe_rank_bytes(moe: MoEModel, at: Launch) -> tuple[int, int]:
    """This rank's bytes in the plans ``experts.moe_predict`` prices: the dense group over every
    rank, and with ``ep`` its expert group, the gpus / ep ranks ep apart (group rank rank // ep);
    experts whole on their rank move nothing."""
    dense = rank_traffic(list(moe.dense), at.gpus, at.rank, max_round_bytes=at.max_round_bytes)
    sent, received = dense.sent, dense.received
    fsdp = at.gpus // at.ep if at.ep else 1
    if at.ep and fsdp > 1:
        shapes = moe.expert_shapes(moe.experts // at.ep)
        limit = at.max_round_bytes // at.ep if at.max_round_bytes else None  # as moe_predict's rounds
        group = rank_traffic(shapes, fsdp, at.rank // at.ep, max_round_bytes=limit)
        sent, received = sent + group.sent, received + group.received
    return sent, received


def _moe_memory(moe: MoEModel, at: Launch) -> tuple[int, int] | None:
    """This rank's momentum and peak transient from ``experts.moe_memory``, up to ``MODELLED_MEMORY_RANKS``."""
    if at.gpus > MODELLED_MEMORY_RANKS:
        return None
    figures = moe_memory(moe, ExpertLayout(at.gpus, at.ep), at.max_round_bytes)
    return figures["momentum"][at.rank], figures["peak_transient"][at.rank]


def _rank_bytes(
    shapes: list[tuple[int, int]], shard: int, rank: int, hsdp: int, owners: str, limit: int | None
) -> tuple[int, int]:
    """This rank's bytes sent and received in the plan the cost model prices (``traffic.rank_traffic``)."""
    t = rank_traffic(shapes, shard, rank, replicas=hsdp, owners=owners, max_round_bytes=limit)
    return t.sent, t.received


# Ranks up to which the rehearsal prices this rank's memory with the cost model's plan (it plans every
# rank of the group: seconds at 1,024 ranks); plan --check prices larger layouts.
MODELLED_MEMORY_RANKS = 1024


def _modelled_memory(
    shapes: list[tuple[int, int]], shard: int, hsdp: int, tp: int, rank: int, limit: int | None
) -> tuple[int, int] | None:
    """This rank's momentum and peak transient from ``plans.rank_memory`` (one-dimensional shards, owners
    per replica), or None for TP layouts and groups above ``MODELLED_MEMORY_RANKS``."""
    if tp > 1 or shard > MODELLED_MEMORY_RANKS:
        return None
    momentum, peak = rank_memory(tuple(shapes), shard, hsdp, False, limit)
    return momentum[rank % shard], peak[rank % shard]
