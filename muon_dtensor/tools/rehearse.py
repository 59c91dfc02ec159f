"""``python -m muon_dtensor plan --rehearse CONFIG --gpus N --rank R [--hsdp H] [--tp T] [--skip-ns]``:
one rank's real optimizer step for a model on N ranks, in this process, on torch's ``fake`` backend
(one process plays rank R of N; collectives return at once and move nothing; docs/scale.md).

It builds the model's Muon matrices (a preset or a ``config.json``, as ``plan --check`` reads them)
as DTensors holding rank R's real local shard, laid out as FSDP2 would (``Shard(0)``; with ``--tp``,
q, k, v, gate and up ``Shard(0)`` and o and down ``Shard(1)`` on the TP axis, FSDP2's
``_StridedShard`` over them; with ``--hsdp``, replicated over the replica axis), steps ``Muon`` on
them and prints the first step's set-up, the steady step's host time, its host ops and collectives
(with each one's bytes), the process groups created and the plans' memory on this rank, each beside
the cost model's figure where it has one. ``--skip-ns``: the matrices this rank owns are not
orthogonalized (their Newton-Schulz on a CPU is minutes for a 28,672 x 8,192 matrix); the output
says so and how many it owned. Only the Muon matrices are built (AdamW's parameters step locally).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..base.compat import StridedShard as _StridedShard
from ..base.torch_dist import fake_store, local_shape, process_group_count
from ..numerics.newton_schulz import orthogonalize
from ..optim.optimizer import Muon
from ..planning.cli import check_options, owner_options
from ..planning.costmodel import CURRENT_CPU, Prediction, predict
from ..planning.hardware import Hardware
from ..planning.host_ops import StepShape, step_ops
from ..planning.inputs import GPUS, format_bytes
from ..planning.plans import rank_memory
from ..planning.traffic import rank_traffic
from ..sharding.plan.blocks import block_numel
from ..sharding.plan.build import DEFAULT_ROUND_BYTES
from .configs import PRESETS, load_config, meta_model, muon_matrices, validate_config
from .topology import _COLWISE, _ROWWISE, _split, parse_layout

__all__ = ["Rehearsal", "main", "parse_args", "rehearse", "report"]

# Bytes of this rank's shards (parameters, gradients, momentum) above which a rehearsal is refused:
# a rank of a small world holds most of a large model.
MAX_LOCAL_BYTES = 16 << 30


@dataclass
class Rehearsal:
    """What one rank's rehearsal measured (process time: other work on the machine does not count)."""

    matrices: int
    local_elements: int
    setup_s: float
    steady_s: float
    host_ops: int
    collectives: list[tuple[str, int]]  # (name, bytes of its buffers) per collective of a steady step
    sent: int  # bytes this rank sent to others in a steady step (both exchanges)
    received: int
    groups_mesh: int  # process groups the meshes created
    groups_optimizer: int  # process groups the optimizer's first step created
    owned: int  # matrices this rank orthogonalized in a step
    memory: dict[str, int]
    predicted_ops: int
    prediction: Prediction
    skipped_ns: bool
    modelled_memory: tuple[int, int] | None = None  # momentum and peak, planning.plans.rank_memory
    owners: list[str] = field(default_factory=list)  # HSDP: the owners chosen per mesh, and why
    modelled_bytes: tuple[int, int] = (0, 0)  # this rank's sent and received in the model's plan


def _skip(matrices: Sequence[Tensor], config: Any) -> list[Tensor]:
    """``orthogonalize_fn`` of ``--skip-ns``: the matrices back as they came (no Newton-Schulz)."""
    return list(matrices)


def _mesh(gpus: int, hsdp: int, tp: int) -> DeviceMesh:
    shard = gpus // (hsdp * tp)
    dims = [(n, s) for n, s in (("replicate", hsdp), ("shard", shard), ("tp", tp)) if s > 1 or n == "shard"]
    return init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def _placements(mesh: DeviceMesh, module: str, ndim: int) -> list[Placement]:
    """FSDP2's Shard(0) on the shard axis, over TP's Shard(0) (colwise, then _StridedShard on the
    shard axis) or Shard(1) (rowwise); Replicate on the replica axis; as ``plan --check`` lays out."""
    names = mesh.mesh_dim_names or ()
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    tp_dim = (0 if module in _COLWISE else 1 if module in _ROWWISE else None) if ndim == 2 else None
    out: list[Placement] = []
    for name in names:
        if name == "replicate":
            out.append(Replicate())
        elif name == "shard":
            out.append(_StridedShard(0, split_factor=tp) if tp_dim == 0 and tp > 1 else Shard(0))
        else:
            out.append(Shard(tp_dim) if tp_dim is not None else Replicate())
    return out


def _local(shape: torch.Size, mesh: DeviceMesh, placements: list[Placement], gen: torch.Generator) -> DTensor:
    local = torch.randn(local_shape(shape, mesh, placements), generator=gen) * 0.02
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride, run_check=False)


def _params(model: nn.Module, mesh: DeviceMesh, head_dim: int | None) -> list[dict[str, Any]]:
    """The Muon groups of ``split_params`` with rank R's shards of each matrix, gradients set."""
    muon, heads, _ = _split(model, head_dim)
    gen = torch.Generator().manual_seed(0)
    groups: dict[int | None, list[tuple[str, nn.Parameter]]] = {}
    for name, meta in muon:
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        placements = _placements(mesh, module, meta.ndim)
        p = nn.Parameter(_local(meta.shape, mesh, placements, gen))
        p.grad = _local(meta.shape, mesh, placements, gen)
        groups.setdefault(heads.get(name), []).append((name, p))
    out: list[dict[str, Any]] = []
    for rows, named in groups.items():
        out.append({"params": named, **({"head_dim": rows} if rows else {})})
    return out


def _pg_count() -> int:
    return process_group_count()


def _profiled_step(opt: Muon) -> tuple[int, list[tuple[str, int]]]:
    """One step under the profiler: top-level ``aten::`` ops, and per top-level collective its
    name and the bytes of its buffers (an all-reduce's tensor; an all-to-all's input and output)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        opt.step()
    ops, collectives = 0, []
    for e in prof.profiler.function_events:
        if not e.name.startswith(("aten::", "c10d::")) or not _top_level(e):
            continue
        if e.name.startswith("aten::"):
            ops += 1
            continue
        shapes = e.structured_input_shapes or []
        item = 2 if "BFloat16" in str(e.input_dtypes) else 4 if "Float" in str(e.input_dtypes) else 8
        flat = [s for arg in shapes for s in (arg if arg and isinstance(arg[0], list) else [arg]) if s]
        collectives.append((e.name, sum(math.prod(s) for s in flat) * item))
    return ops, collectives


def _top_level(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::")):
            return False
        parent = parent.cpu_parent
    return True


def _predicted_ops(opt: Muon, skip_ns: bool = False) -> int:
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
                total += sum(step_ops(d.plan, rank, shape).values())
    return total


def rehearse(
    config: dict[str, Any], gpus: int, rank: int, *, hsdp: int = 1, tp: int = 1, skip_ns: bool = False,
    steps: int = 2, head_dim: int | None = None, owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
) -> Rehearsal:  # fmt: skip
    """Rank ``rank`` of ``gpus`` (``hsdp`` replicas x shards x ``tp``) on the fake backend: build its
    shards of ``config``'s Muon matrices, step, and measure. Creates and destroys the default group."""
    if dist.is_initialized():
        raise ValueError("a process group exists already: rehearse in a process of its own")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=gpus)
    hw = Hardware.h200(check_backend="gloo")  # the check on a CPU group, as "cuda:nccl,cpu:gloo"
    # the job's nodes as torchrun names them, so owners="auto" prices the nodes the model does
    node_env = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(hw.gpus_per_node)
    try:
        before = _pg_count()
        mesh = _mesh(gpus, hsdp, tp)
        groups = _params(meta_model(config), mesh, head_dim)
        after_mesh = _pg_count()
        opt = Muon(
            groups, lr=0.02, owners=owners, max_round_bytes=max_round_bytes,  # type: ignore[arg-type]
            orthogonalize_fn=_skip if skip_ns else orthogonalize,
        )  # fmt: skip
        start = time.process_time()
        opt.step()
        setup = time.process_time() - start
        owned = opt.comm_stats.orthogonalized
        start = time.process_time()
        for _ in range(steps):
            opt.step()
        steady = (time.process_time() - start) / steps
        ops, collectives = _profiled_step(opt)
        metrics = opt.metrics()
        shapes = [v.shape for e in opt._plans.entries.values() for vs in e.sharding.views for v in vs]
        shard = gpus // hsdp
        prediction = predict(shapes, shard, hw, replicas=hsdp, owners=owners)
        return Rehearsal(
            matrices=len(shapes),
            local_elements=sum(p.to_local().numel() for g in opt.param_groups for p in g["params"]),
            setup_s=setup, steady_s=steady, host_ops=ops, collectives=collectives,
            sent=int(metrics["muon/bytes_sent"]), received=int(metrics["muon/bytes_received"]),
            groups_mesh=after_mesh - before, groups_optimizer=_pg_count() - after_mesh, owned=owned,
            memory=opt.memory(), predicted_ops=_predicted_ops(opt, skip_ns), prediction=prediction, skipped_ns=skip_ns,
            modelled_memory=_modelled_memory(shapes, shard // tp, hsdp, tp, rank, max_round_bytes),
            modelled_bytes=_rank_bytes(shapes, shard, rank, hsdp, prediction.owners, max_round_bytes),
            owners=[c.describe() for e in opt._plans.entries.values() for c in e.sharding.owner_choices],
        )  # fmt: skip
    finally:
        dist.destroy_process_group()
        if node_env is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = node_env


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


def _memory_model(r: Rehearsal) -> str:
    if r.modelled_memory is None:
        return f"plan --check (TP, or above {MODELLED_MEMORY_RANKS:,} ranks)"
    return f"{format_bytes(r.modelled_memory[0])} / {format_bytes(r.modelled_memory[1])}"


def report(args: argparse.Namespace, r: Rehearsal) -> str:
    """The rehearsal as text, each measured figure beside the cost model's."""
    shard = args.gpus // (args.hsdp * args.tp)
    p = r.prediction
    ns = (
        f"Newton-Schulz skipped (--skip-ns) on the {r.owned} matrices this rank owns: the host times leave it out"
        if r.skipped_ns
        else f"Newton-Schulz run for real on the {r.owned} matrices this rank owns (CPU; --skip-ns leaves it out)"
    )
    counts: dict[str, list[int]] = {}
    for name, nbytes in r.collectives:
        counts.setdefault(name, []).append(nbytes)
    listed = "; ".join(
        f"{n} x{len(b)}: {', '.join(format_bytes(x) for x in b[:6])}{' ...' if len(b) > 6 else ''}"
        for n, b in counts.items()
    )
    mem = r.memory
    return "\n".join(
        [
            f"rehearsal: {args.rehearse} on {args.gpus:,} ranks = {args.hsdp} replica group(s) x {shard:,} "
            f"shards x {args.tp} TP, rank {args.rank}, fake backend (one process; collectives move nothing)",
            f"Muon matrices: {r.matrices:,}; this rank's shard elements: {r.local_elements:,}; {ns}",
            "",
            "| per step, this rank | measured (CPU process time) | cost model (H200, check on gloo) |",
            "|---|---:|---:|",
            f"| first step (set-up and step) | {r.setup_s:.2f} s | not modelled |",
            f"| steady step, host | {r.steady_s * 1e3:.1f} ms | {p.host * 1e3:.2f} ms host of {p.total * 1e3:.1f} ms |",
            f"| host ops (top-level aten) | {r.host_ops:,} | {r.predicted_ops:,} (host_ops.step_ops) |",
            f"| collectives | {len(r.collectives)} | {p.collectives} |",
            f"| bytes sent / received to other ranks | {format_bytes(r.sent)} / {format_bytes(r.received)} "
            f"| {format_bytes(r.modelled_bytes[0])} / {format_bytes(r.modelled_bytes[1])} (this rank); "
            f"{format_bytes(int(p.bytes_sent_mean))} sent (mean), {format_bytes(int(p.bytes_sent_max))} (max) |",
            f"| momentum / peak transient (Muon.memory) | {format_bytes(mem.get('momentum', 0))} / "
            f"{format_bytes(mem['peak_transient'])} | {_memory_model(r)} |",
            "",
            f"collectives of a steady step (buffer bytes): {listed or 'none'}",
            f"process groups created: {r.groups_mesh} by the meshes, {r.groups_optimizer} by the optimizer",
            *(f"owners: {line}; the cost model's: {p.owners}" for line in r.owners),
        ]
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``plan --rehearse``'s arguments; exits with status 2 on bad ones (0 for ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan --rehearse",
        description="Run one rank's real Muon step for a model on N ranks in this process, on torch's "
        "fake backend, and print its set-up, host time, ops, collectives and memory beside the cost model's.",
    )
    p.add_argument(
        "--rehearse", nargs="?", metavar="CONFIG", help=f"config.json or a preset ({', '.join(PRESETS)})"
    )
    p.add_argument("--gpus", type=GPUS, required=True, help="ranks in all")
    p.add_argument("--rank", type=int, default=0, help="the rank this process plays (0)")
    p.add_argument("--steps", type=int, default=2, help="steady steps timed (2)")
    p.add_argument("--skip-ns", action="store_true", help="skip Newton-Schulz on the matrices this rank owns")
    check_options(p)
    owner_options(p)
    args = parse_layout(p, argv, "rehearse")
    if not 0 <= args.rank < args.gpus:
        p.error(f"--rank {args.rank} must be between 0 and --gpus - 1 ({args.gpus - 1})")
    if args.steps < 1:
        p.error(f"--steps must be at least 1 but is {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Print the rehearsal; 0, or 2 for bad arguments or a model too large for one rank's memory."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        config = load_config(args.rehearse)
        validate_config(config)
        head_dim = args.head_dim if args.head_dim is not None else config.get("head_dim")
        muon_matrices(config, head_dim or None)
        _fits(config, args.gpus // args.hsdp)
    except ValueError as e:
        print(f"error: --rehearse {args.rehearse!r}: {e}", file=sys.stderr)
        return 2
    found = rehearse(
        config, args.gpus, args.rank, hsdp=args.hsdp, tp=args.tp, skip_ns=args.skip_ns, steps=args.steps,
        head_dim=head_dim or None, owners=args.owners, max_round_bytes=args.max_round_bytes or None,
    )  # fmt: skip
    print(report(args, found))
    return 0


def _fits(config: dict[str, Any], ranks: int) -> None:
    """Refuse a rehearsal whose shards would not fit in memory: parameters, gradients and momentum
    in float32, the model's matrices over ``ranks`` ranks (one replica)."""
    shapes = [tuple(p.shape) for _, p in meta_model(config).named_parameters() if p.ndim >= 2]
    nbytes = 12 * sum(math.prod(s) for s in shapes) // ranks
    if nbytes > MAX_LOCAL_BYTES:
        raise ValueError(
            f"one rank's shards would take about {format_bytes(nbytes)} (parameters, gradients, momentum), "
            f"above {format_bytes(MAX_LOCAL_BYTES)}: rehearse on more ranks"
        )
