"""``python -m muon_dtensor plan --rehearse CONFIG --gpus N (--rank R | --busiest) [--hsdp H] [--tp T]
[--ep E] [--skip-ns]``: one rank's real optimizer step for a model on N ranks, in this process, on torch's ``fake`` backend
(one process plays rank R of N; collectives return at once and move nothing; docs/scale.md).

It builds the model's Muon matrices (a preset or a ``config.json``, as ``plan --check`` reads them)
as DTensors holding rank R's real local shard, laid out as FSDP2 would (``Shard(0)``; with ``--tp``,
q, k, v, gate and up ``Shard(0)`` and o and down ``Shard(1)`` on the TP axis, FSDP2's
``_StridedShard`` over them; with ``--hsdp``, replicated over the replica axis; expert stacks
``[E, out, in]`` with ``"experts": True``, and with ``--ep`` ``Shard(0)`` over ep and ``Shard(1)`` over
the gpus / ep ranks of each, as torchtitan lays them out), steps ``Muon`` on them and measures the first step's set-up, the steady step's host time, its host ops and collectives
(with each one's bytes), the process groups created and the plans' memory on this rank, each beside
the cost model's figure where it has one (its report and the checks before it: ``rehearse_report``).
``--skip-ns``: the matrices this rank owns are not orthogonalized (their Newton-Schulz on a CPU is
minutes for a 28,672 x 8,192 matrix). Only the Muon matrices are built (AdamW's step locally).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..base.compat import StridedShard as _StridedShard
from ..base.compat import TorchDispatchMode, tree_leaves
from ..base.op_count import top_level_ops
from ..base.torch_dist import fake_store, local_shape, process_group_count
from ..numerics.newton_schulz import orthogonalize
from ..optim.optimizer import Muon
from ..planning.costmodel import Prediction
from ..planning.hardware import Hardware
from ..planning.inputs import format_bytes
from ..sharding.plan.build import DEFAULT_ROUND_BYTES
from . import rehearse_model
from .configs import meta_model
from .launch_check import _COLWISE, _ROWWISE, _split, moe_model

__all__ = ["Rehearsal", "rehearse"]

Progress = Callable[[str], None]
# Bytes per shard element of the step's transients (exchange buffers, Newton-Schulz's inputs and the
# update) above the 12 of parameter, gradient and momentum, and bytes of a step whatever its size (the
# profiler, the fake group): fitted to peaks measured on 2, 4, 8 and 16 ranks (test_rehearse_memory.py).
# 10 MiB less since the count reads the profiler's raw events, not its event tree (stop 61: the peak
# on 16 ranks fell from 183.0 to 173.4 MiB; bound over peak 1.10, 0.98, 0.98, 1.14 on 2, 4, 8, 16).
TRANSIENT_BYTES = 5
STEP_BYTES = 70 << 20
# Modelled host ops above which the step is not profiled: the profiler keeps every event of the step
# with its shapes (1,400 tiny matrices took 1 GiB and seconds; 14,000 grew past 6 GiB), so the host ops
# and collectives are then reported as not counted.
MAX_PROFILED_OPS = 20_000


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
    memory_bound: int = 0  # memory_bound(shard elements): the bytes the refusal above max_bytes reads
    shapes: tuple[tuple[int, int], ...] = ()  # the matrices, as the cost model takes them
    owners: list[str] = field(default_factory=list)  # HSDP: the owners chosen per mesh, and why
    modelled_bytes: tuple[int, int] = (0, 0)  # this rank's sent and received in the model's plan


def _skip(matrices: Sequence[Tensor], config: Any) -> list[Tensor]:
    """``orthogonalize_fn`` of ``--skip-ns``: the matrices back as they came (no Newton-Schulz)."""
    return list(matrices)


def _meshes(gpus: int, hsdp: int, tp: int, ep: int | None) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The mesh of the dense matrices, and with ``ep`` the experts' (gpus / ep, ep): ep ranks
    consecutive, as torchtitan's ``dp_shard_mod_ep`` x ``ep``."""
    shard = gpus // (hsdp * tp)
    dims = [(n, s) for n, s in (("replicate", hsdp), ("shard", shard), ("tp", tp)) if s > 1 or n == "shard"]
    mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    if ep is None:
        return mesh, None
    return mesh, init_device_mesh("cpu", (gpus // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))


def _placements(mesh: DeviceMesh, module: str, ndim: int) -> list[Placement]:
    """FSDP2's Shard(0) on the shard axis, over TP's Shard(0) (colwise, then _StridedShard on the
    shard axis) or Shard(1) (rowwise); Replicate on the replica axis; as ``plan --check`` lays out.
    On the experts' mesh: rows Shard(1) over dp_shard_mod_ep, experts Shard(0) over ep."""
    names = mesh.mesh_dim_names or ()
    if names == ("dp_shard_mod_ep", "ep"):
        return [Shard(1), Shard(0)]
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
    # filled in place: no temporary as large as the shard (the memory bound counts the shards alone)
    local = torch.empty(local_shape(shape, mesh, placements)).normal_(0.0, 0.02, generator=gen)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, shape=shape, stride=stride, run_check=False)


def _layouts(
    model: nn.Module, meshes: tuple[DeviceMesh, DeviceMesh | None], head_dim: int | None
) -> list[tuple[str, torch.Size, DeviceMesh, list[Placement], int | None]]:
    """Each Muon parameter of ``split_params`` (expert stacks included): name, global shape, mesh,
    placements and rows per head (None: whole matrices)."""
    muon, heads, _ = _split(model, head_dim)
    out = []
    for name, meta in muon:
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        mesh = meshes[1] if meta.ndim == 3 and meshes[1] is not None else meshes[0]
        out.append((name, meta.shape, mesh, _placements(mesh, module, meta.ndim), heads.get(name)))
    return out


def local_elements(layouts: Sequence[tuple[str, torch.Size, DeviceMesh, list[Placement], int | None]]) -> int:
    """Elements of this rank's shards of ``layouts`` (before any is built)."""
    return sum(math.prod(local_shape(shape, mesh, pl)) for _, shape, mesh, pl, _ in layouts)


def _params(
    layouts: Sequence[tuple[str, torch.Size, DeviceMesh, list[Placement], int | None]],
) -> list[dict[str, Any]]:
    """The Muon groups (per rows per head; expert stacks ``"experts": True``) with this rank's shard
    of each matrix, gradients set."""
    gen = torch.Generator().manual_seed(0)
    groups: dict[tuple[int | None, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, shape, mesh, placements, rows in layouts:
        p = nn.Parameter(_local(shape, mesh, placements, gen))
        p.grad = _local(shape, mesh, placements, gen)
        groups.setdefault((rows, len(shape) == 3), []).append((name, p))
    return [
        {"params": named, **({"head_dim": rows} if rows else {}), **({"experts": True} if experts else {})}
        for (rows, experts), named in groups.items()
    ]


def _pg_count() -> int:
    return process_group_count()


class _Collectives(TorchDispatchMode):
    """The step's collectives as they are dispatched: name and the bytes of their tensors (an
    all-reduce's tensor; an all-to-all's input and output)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.name()
        if name.startswith("c10d::"):
            tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)]
            self.seen.append((name.split(".")[0], sum(t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


def _profiled_step(opt: Muon) -> tuple[int, list[tuple[str, int]]]:
    """Two steps: one under the profiler, counting top-level ``aten::`` ops and collectives, and one
    that records each collective's name and the bytes of its buffers (``_Collectives``). The
    profiler's shapes would cost hundreds of MiB on a rank that owns many matrices (560 MiB on 2
    ranks of an 8-layer model of width 1024), so it records none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        opt.step()
    top = top_level_ops(prof)
    ops = sum(1 for name in top if name.startswith("aten::"))
    counted = len(top) - ops
    with _Collectives() as mode:
        opt.step()
    if len(mode.seen) != counted:  # a bug, not a user error: the two steps must run the same collectives
        raise AssertionError(
            f"the profiler counted {counted} collectives and the step dispatched {len(mode.seen)}"
        )
    return ops, mode.seen


class _CountedNS:
    """``orthogonalize`` that reports its progress (matrices done, CPU seconds) at most every
    ``every`` seconds: a real Newton-Schulz on a CPU takes minutes per large matrix."""

    def __init__(self, progress: Progress | None, every: float = 10.0) -> None:
        self.progress, self.every, self.done = progress, every, 0
        self.start = self.last = time.process_time()

    def __call__(self, matrices: Sequence[Tensor], config: Any) -> list[Tensor]:
        out = orthogonalize(matrices, config)
        self.done += len(matrices)
        now = time.process_time()
        if self.progress is not None and now - self.last >= self.every:
            self.progress(f"Newton-Schulz: {self.done:,} matrices done, {now - self.start:,.0f} s of CPU")
            self.last = now
        return out


def rehearse(
    config: dict[str, Any], gpus: int, rank: int, *, hsdp: int = 1, tp: int = 1, skip_ns: bool = False,
    steps: int = 2, head_dim: int | None = None, owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES, ep: int | None = None, hw: Hardware | None = None,
    max_bytes: int | None = None, progress: Progress | None = None, muon_options: Mapping[str, Any] | None = None,
) -> Rehearsal:  # fmt: skip
    """Rank ``rank`` of ``gpus`` (``hsdp`` replicas x shards x ``tp``; expert stacks over ``ep`` x gpus /
    ``ep``) on the fake backend: build its shards of ``config``'s Muon matrices, step, and measure,
    beside ``modelled_step`` on ``hw``. ValueError before any shard is built when the bound
    (``memory_bound``) is above ``max_bytes``. ``progress`` receives a line per phase; ``muon_options``
    go to ``Muon`` (``ns_steps``, ``ns_algorithm``, ``ns_split``). Creates and destroys the default group."""
    say = progress or (lambda line: None)
    hw = hw or Hardware.h200(check_backend="gloo")  # a fake group's check runs on the host, as gloo's
    launch = rehearse_model.Launch(gpus, rank, hsdp, tp, ep, owners, max_round_bytes)
    with _fake_world(gpus, rank, hw):
        before = _pg_count()
        model = meta_model(config)
        layouts = _layouts(model, _meshes(gpus, hsdp, tp, ep), head_dim)
        bound = memory_bound(local_elements(layouts))
        if max_bytes is not None and bound > max_bytes:
            raise ValueError(
                f"rank {rank}'s shards and its step would take about {format_bytes(bound)}, above "
                f"{format_bytes(max_bytes)}: rehearse on more ranks"
            )  # before any shard is built
        say(
            f"building rank {rank}'s shards of {len(layouts):,} parameters (about {format_bytes(bound)} at the peak)"
        )
        groups = _params(layouts)
        after_mesh = _pg_count()
        opt = Muon(
            groups, lr=0.02, owners=owners, max_round_bytes=max_round_bytes,  # type: ignore[arg-type]
            orthogonalize_fn=_skip if skip_ns else _CountedNS(progress), **dict(muon_options or {}),
        )  # fmt: skip
        measured = _measure(opt, steps, say, skip_ns)
        modelled = rehearse_model.modelled(
            measured["shapes"], launch, moe_model(model, head_dim), hw, muon_options or {}
        )
        return Rehearsal(
            **measured, **modelled, groups_mesh=after_mesh - before, groups_optimizer=_pg_count() - after_mesh,
            memory_bound=bound,
        )  # fmt: skip


@contextlib.contextmanager
def _fake_world(gpus: int, rank: int, hw: Hardware) -> Iterator[None]:
    """The default group on the fake backend as rank ``rank`` of ``gpus``, and ``LOCAL_WORLD_SIZE`` as
    torchrun would set it for ``hw``'s nodes (so ``owners="auto"`` prices the nodes the model does);
    both undone on the way out."""
    if dist.is_initialized():
        raise ValueError("a process group exists already: rehearse in a process of its own")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=gpus)
    node_env = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(hw.gpus_per_node)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if node_env is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = node_env


def _measure(opt: Muon, steps: int, say: Progress, skip_ns: bool) -> dict[str, Any]:
    """``Rehearsal``'s measured fields: the steps' times, ops, collectives and bytes, and the model's
    host ops for this rank's own plans (``_predicted_ops``)."""
    setup, owned, steady, predicted, ops, collectives = _steps(opt, steps, say, skip_ns)
    metrics = opt.metrics()
    shapes = [v.shape for e in opt._plans.entries.values() for vs in e.sharding.views for v in vs]
    return dict(
        matrices=len(shapes),
        local_elements=sum(p.to_local().numel() for g in opt.param_groups for p in g["params"]),
        setup_s=setup, steady_s=steady, host_ops=ops, collectives=collectives,
        sent=int(metrics["muon/bytes_sent"]), received=int(metrics["muon/bytes_received"]),
        owned=owned, memory=opt.memory(), predicted_ops=predicted, skipped_ns=skip_ns, shapes=tuple(shapes),
        owners=[c.describe() for e in opt._plans.entries.values() for c in e.sharding.owner_choices],
    )  # fmt: skip


def _steps(
    opt: Muon, steps: int, say: Progress, skip_ns: bool
) -> tuple[float, int, float, int, int, list[tuple[str, int]]]:
    """The first step's CPU time and matrices orthogonalized, a steady step's CPU time, the modelled
    host ops, and the profiled step's host ops and collectives (-1 and none above ``MAX_PROFILED_OPS``)."""
    say("first step (set-up and step)")
    start = time.process_time()
    opt.step()
    setup = time.process_time() - start
    owned = opt.comm_stats.orthogonalized
    say(f"first step: {setup:.2f} s of CPU; {steps} steady step(s), then one under the profiler")
    start = time.process_time()
    for _ in range(steps):
        opt.step()
    steady = (time.process_time() - start) / steps
    predicted = rehearse_model.predicted_ops(opt, skip_ns)
    say(f"steady step: {steady * 1e3:,.1f} ms of CPU; {predicted:,} modelled host ops")
    ops, collectives = _profiled_step(opt) if predicted <= MAX_PROFILED_OPS else (-1, [])
    return setup, owned, steady, predicted, ops, collectives


def memory_bound(elements: int) -> int:
    """Bytes a rehearsal holding ``elements`` float32 elements of shards peaks at above the interpreter:
    parameters, gradients and momentum (4 bytes each), the step's transients (``TRANSIENT_BYTES`` per
    element) and ``STEP_BYTES`` (measured: tests/tools/test_rehearse_memory.py)."""
    return elements * (12 + TRANSIENT_BYTES) + STEP_BYTES
