"""The step's collectives: small integer sums and maxima for the checks and QK-Clip (on the host
where the groups have a CPU backend), object gathers, and the all-to-all that carries matrix blocks
to their owners and back. Blocks travel in the Newton-Schulz dtype (bfloat16 by default): the owner
casts to it anyway, so sending it halves the bytes and changes no bit of the result. Process groups
are created in ``groups.py``; the checkpoint's own collectives are in ``checkpoint/collectives.py``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ...base.compat import all_gather_single, has_cpu_backend
from ...base.torch_dist import default_group
from ..plan.runs import segments
from .failures import wait_released
from .groups import check_groups

__all__ = [
    "CommStats",
    "gather_objects",
    "fake_refusal",
    "gather_over_scope",
    "max_over_group",
    "max_over_mesh",
    "pack_chunks",
    "rank_and_size",
    "simulated",
    "start_all_to_all",
    "start_exchange",
    "sum_over_group",
    "sum_over_mesh",
    "sum_over_scopes",
]


class CommStats:
    """Bytes this rank sent to and received from other ranks, collectives issued and matrices
    this rank orthogonalized, for benchmarks and tests; ``sent_to`` splits ``sent`` by
    destination (global rank), e.g. into bytes within and across HSDP replicas. Since the last
    ``begin_step``: the update's sum of squares over this rank's pieces (a device scalar, read only
    when asked: ``Muon.metrics``), their element count, and the host seconds of Newton-Schulz."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sent = self.received = self.collectives = self.orthogonalized = 0
        self.live_bytes = self.peak_bytes = 0
        self.sent_to: dict[int, int] = {}
        self.begin_step()

    def begin_step(self) -> None:
        self.base = (self.sent, self.received, self.collectives, self.orthogonalized)
        self.update_sq: Tensor | None = None
        self.update_elements = 0
        self.ns_seconds = 0.0

    def hold(self, nbytes: int) -> None:
        """Exchange buffers (sends, receives, assembled matrices) allocated; tracks the peak."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def __repr__(self) -> str:
        """The figures, bytes as plain integers: ``CommStats(sent=..., received=..., ...)``."""
        return (
            f"CommStats(sent={self.sent}, received={self.received}, collectives={self.collectives}, "
            f"orthogonalized={self.orthogonalized}, peak_bytes={self.peak_bytes})"
        )


def simulated(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (None: the default group) runs on torch's ``fake`` backend, where one process
    plays one rank of a world of any size and collectives return at once, moving nothing. The one
    place the package asks: on such a group a sum is the sum as if every rank held this rank's values,
    and a gather holds this rank's value for every rank (docs/design.md, "The fake backend").

    That answer is true only where every rank is this one: a fake group of more than one rank in a
    job whose default group is real hands each rank its own values as everyone's (wrong sums, no
    agreement). ``fake_refusal`` names such a group; the step, the group checks and QK-Clip ask it
    before any collective and raise on every rank, so no step runs over one."""
    return _fake(group)


def _fake(group: dist.ProcessGroup | None) -> bool:
    try:
        return str(dist.get_backend(group)).lower() == "fake"
    except (RuntimeError, ValueError):  # no process group, or a group this rank is not in
        return False


def fake_refusal(scope: DeviceMesh | dist.ProcessGroup | None, name: str) -> str | None:
    """Why ``scope`` (a group, or each axis of a mesh) cannot be simulated truthfully, or None: a
    fake group of more than one rank inside a job whose default group is real. Degree-1 fake axes
    (torchtitan's meshes inside a real job) take no collective and are fine. Local, no collective."""
    if scope is None or _fake(None):
        return None
    axes = [scope.get_group(a) for a in range(scope.ndim)] if isinstance(scope, DeviceMesh) else [scope]
    for axis, group in enumerate(axes):
        if _fake(group) and dist.get_world_size(group) > 1:
            where = (
                f"axis {axis} of the mesh of ranks {scope.mesh.flatten().tolist()}"
                if isinstance(scope, DeviceMesh)
                else "it"
            )
            return (
                f"{name} runs on torch's fake backend over {dist.get_world_size(group)} ranks "
                f"({where}: ranks {dist.get_process_group_ranks(group)}) in a job whose default group is "
                f"{dist.get_backend()}: a fake collective moves nothing, so each rank would take its own "
                "values for every rank's. Give that group or mesh axis a real backend (drop its "
                "backend_override), or make it one rank; a fake group belongs to a fake world "
                '(init_process_group("fake", ...), docs/scale.md)'
            )
    return None


def sum_over_mesh(counts: Tensor, mesh: DeviceMesh) -> Tensor:
    """Sum a CPU integer tensor over every rank of ``mesh``, one all-reduce per mesh axis.

    Summing axis by axis reaches every rank of the mesh without creating a new process group, and
    touches only ranks of this mesh, so a pipeline stage never waits on another stage.
    """
    return _sum_on_host(
        counts, [mesh.get_group(a) for a in range(mesh.ndim) if mesh.size(a) > 1], mesh.device_type
    )


def sum_over_group(counts: Tensor, group: dist.ProcessGroup, device_type: str = "cpu") -> Tensor:
    return _sum_on_host(counts, [group] if dist.get_world_size(group) > 1 else [], device_type)


def _sum_on_host(counts: Tensor, groups: Sequence[dist.ProcessGroup], device_type: str) -> Tensor:
    """The preflight's and the agreement's sums: host-side facts, so they stay off the device
    stream wherever the groups have a CPU backend (gloo, or "cuda:nccl,cpu:gloo" as torchtitan
    initializes). A device-only group (plain "nccl") takes a device round trip: a host sync."""
    if not all(has_cpu_backend(g) for g in groups):
        _warn_device_round_trip()
    return _reduce_on_host(counts, groups, device_type, dist.ReduceOp.SUM)


def max_over_mesh(values: Tensor, mesh: DeviceMesh) -> Tensor:
    """Elementwise max of a float tensor over every rank of ``mesh``, one all-reduce per mesh axis
    (QK-Clip's per-head max logits: every rank must scale by the same factors). Returns a CPU copy.
    MAX is exact and order-free, so every rank holds the same bits."""
    groups = [mesh.get_group(a) for a in range(mesh.ndim) if mesh.size(a) > 1]
    return _reduce_on_host(values, groups, mesh.device_type, dist.ReduceOp.MAX)


def max_over_group(values: Tensor, group: dist.ProcessGroup | None, device_type: str = "cpu") -> Tensor:
    """``max_over_mesh`` over a process group (None: the default group)."""
    group = group if group is not None else default_group()
    return _reduce_on_host(
        values, [group] if dist.get_world_size(group) > 1 else [], device_type, dist.ReduceOp.MAX
    )


def _reduce_on_host(
    values: Tensor, groups: Sequence[dist.ProcessGroup], device_type: str, op: dist.ReduceOp.RedOpType
) -> Tensor:
    """A CPU copy of ``values`` reduced with ``op`` over each group in turn: on the host where every
    group has a CPU backend, else through the device. A copy either way: callers reduce the same
    values over several scopes."""
    target = "cpu" if all(has_cpu_backend(g) for g in groups) else device_type
    out = values.detach()
    out = out.clone() if out.device.type == target else out.to(target)
    for group in groups:
        # a ring over thousands of ranks: a butterfly of two-rank sums instead (``check_groups``)
        steps = check_groups(group) if target == "cpu" else [(group, False)]
        fake = simulated(group)
        for step, adds_nothing in steps:
            if adds_nothing and op == dist.ReduceOp.SUM and not fake:  # a folded rank takes the total
                out.zero_()
            if step is group:
                wait_released(dist.all_reduce(out, op=op, group=step, async_op=True), out.device)
            else:
                _pair_reduce(out, step, op, fake)
        if op == dist.ReduceOp.SUM and fake:  # every rank of it as this one (MAX is already)
            out.mul_(dist.get_world_size(group))
    return out if out.device.type == "cpu" else out.cpu()


def _pair_reduce(out: Tensor, pair: dist.ProcessGroup, op: dist.ReduceOp.RedOpType, fake: bool) -> None:
    """``out`` reduced over a butterfly's two-rank group as an all-gather: one message each way, where
    gloo's ring all-reduce takes four in turn. Both ranks reduce the same two rows in group order,
    so they hold the same bits. On a fake group nothing moves: ``out`` stays this rank's."""
    flat = out.view(-1)  # a contiguous copy (``_reduce_on_host``): written through the view
    both = flat.new_empty(2 * flat.numel())  # concatenated: gloo refuses the stacked form
    wait_released(all_gather_single(both, flat, group=pair, async_op=True), out.device)
    if fake:
        return
    first, second = both.view(2, -1)
    if op == dist.ReduceOp.SUM:
        torch.add(first, second, out=flat)
    else:
        assert op == dist.ReduceOp.MAX, op
        torch.maximum(first, second, out=flat)


@functools.cache
def _warn_device_round_trip() -> None:
    warnings.warn(
        "muon_dtensor: a process group of the optimizer's parameters has no CPU backend, so each "
        "step's checks (a few integers per mesh axis) go through the device and wait for it; "
        'init_process_group(backend="cuda:nccl,cpu:gloo") keeps them on the host',
        stacklevel=4,
    )


def sum_over_scopes(
    counts: Tensor, scopes: Sequence[DeviceMesh | dist.ProcessGroup]
) -> list[tuple[Tensor, int]]:
    """``counts`` summed over each scope (a mesh or a process group), with the scope's rank count."""
    out = []
    for scope in scopes:
        if isinstance(scope, DeviceMesh):
            out.append((sum_over_mesh(counts, scope), scope.size()))
        else:
            out.append((sum_over_group(counts, scope), dist.get_world_size(scope)))
    return out


def gather_over_scope(value: Any, scope: DeviceMesh | dist.ProcessGroup) -> dict[int, Any]:
    """Every rank's ``value`` that this rank can reach in ``scope``: over each axis of a mesh (no new
    group needed), or over the group; keyed by global rank. Collective over the scope."""
    groups = [scope.get_group(a) for a in range(scope.ndim)] if isinstance(scope, DeviceMesh) else [scope]
    out: dict[int, Any] = {}
    for group in groups:
        out.update(zip(dist.get_process_group_ranks(group), gather_objects(value, group)))
    return out


def rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This rank's index and the rank count of ``group`` (0 and 1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _solo(group: dist.ProcessGroup | None) -> bool:
    return rank_and_size(group)[1] == 1


def gather_objects(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value``, in group rank order, on every rank."""
    if _solo(group):
        return [value]
    if simulated(group):  # the fake backend moves no object: every rank holds this one's
        return [value] * dist.get_world_size(group)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def start_all_to_all(
    chunks: Sequence[Sequence[Tensor]],
    recv_numels: Sequence[int],
    *,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
) -> Callable[[], list[Tensor]]:
    """Start sending ``chunks[d]`` (flattened, concatenated) to group rank ``d``; the returned
    function waits and returns what each rank sent here. Work overlaps until then.

    ``recv_numels[s]`` is how many elements group rank ``s`` sends here; every rank knows it from
    the plan, so no size exchange precedes the data.
    """
    send, send_numels = pack_chunks(chunks, dtype=dtype, device=device)
    finish = start_exchange(send, send_numels, recv_numels, group=group, stats=stats)
    return lambda: list(finish().split(list(recv_numels)))


def pack_chunks(
    chunks: Sequence[Sequence[Tensor]], *, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, list[int]]:
    """``chunks[d]`` flattened and concatenated in rank order: the send buffer and its segments."""
    send_numels = [sum(c.numel() for c in per_dest) for per_dest in chunks]
    flat = [c for per_dest in chunks for c in per_dest]
    if flat and all(c.dtype == dtype for c in flat):
        return _cat_flat(flat, sum(send_numels)), send_numels
    send = torch.empty(sum(send_numels), dtype=dtype, device=device)
    offset = 0
    for c in (c for per_dest in chunks for c in per_dest):
        # One copy straight into the send buffer (casting, and gathering strided results).
        send[offset : offset + c.numel()].view(c.shape).copy_(c)
        offset += c.numel()
    return send, send_numels


def _cat_flat(pieces: Sequence[Tensor], total: int) -> Tensor:
    """``pieces`` flattened and concatenated: each run of same-width 2-D pieces one row-wise ``cat``
    (no op per piece), the others flattened one by one (``runs.segments``)."""
    parts = segments([p.shape[1] if p.ndim == 2 else None for p in pieces])
    if len(parts) == 1:
        cols = parts[0][2]
        if cols is not None:
            return torch.cat(list(pieces)).view(-1)
        return torch.cat([p.reshape(-1) for p in pieces])
    send = pieces[0].new_empty(total)
    offset = 0
    for first, stop, cols in parts:
        group = list(pieces[first:stop])
        numel = sum(p.numel() for p in group)
        dest = send[offset : offset + numel]
        if cols is not None:
            torch.cat(group, out=dest.view(sum(p.shape[0] for p in group), cols))
        else:
            torch.cat([p.reshape(-1) for p in group], out=dest)
        offset += numel
    return send


def start_exchange(
    send: Tensor,
    send_numels: Sequence[int],
    recv_numels: Sequence[int],
    *,
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
) -> Callable[[], Tensor]:
    """``start_all_to_all`` with the send buffer already packed: ``send_numels[d]`` elements of
    ``send``, in rank order, go to group rank ``d``; the returned function waits and returns the
    flat receive buffer (segments in rank order)."""
    me = dist.get_rank(group)
    wire, wire_sends, wire_recvs, pad = _padded(send, send_numels, recv_numels, group)
    recv = send.new_empty(sum(wire_recvs))
    work = dist.all_to_all_single(recv, wire, wire_recvs, wire_sends, group=group, async_op=True)
    item = recv.element_size()
    if stats is not None:
        stats.sent += (sum(send_numels) - send_numels[me]) * item
        for dest, numel in zip(dist.get_process_group_ranks(group), send_numels):
            if numel and dest != dist.get_rank():
                stats.sent_to[dest] = stats.sent_to.get(dest, 0) + numel * item
        stats.received += (sum(recv_numels) - recv_numels[me]) * item
        stats.collectives += 1
        stats.hold((send.numel() + sum(recv_numels)) * item)

    def finish() -> Tensor:
        wait_released(work, recv.device)
        if stats is not None:
            stats.release(send.numel() * item)  # ``send`` dies here; ``recv`` lives on in views
        return recv if pad is None else _unpad(recv, pad)

    return finish


def _padded(
    send: Tensor, send_numels: Sequence[int], recv_numels: Sequence[int], group: dist.ProcessGroup
) -> tuple[Tensor, list[int], list[int], tuple[int, int] | None]:
    """The send buffer and counts on the wire. On the fake backend (``simulated``), which refuses
    an empty input with a non-empty output and fills each output slot by repeating the input, a
    rank that sends nothing but receives sends itself as many elements as its largest slot (gloo
    and NCCL take an empty input as it is). With the padding's offset and length, else None."""
    sends, recvs = list(send_numels), list(recv_numels)
    if send.numel() or not sum(recvs) or not simulated(group):
        return send, sends, recvs, None
    me, pad = dist.get_rank(group), max(recvs)
    sends[me] += pad
    recvs[me] += pad
    return send.new_zeros(pad), sends, recvs, (sum(recv_numels[: me + 1]), pad)


def _unpad(recv: Tensor, pad: tuple[int, int]) -> Tensor:
    """The receive buffer without the elements a rank sent itself (``_padded``)."""
    at, length = pad
    if at + length == recv.numel():
        return recv[:at]
    return torch.cat((recv[:at], recv[at + length :]))
