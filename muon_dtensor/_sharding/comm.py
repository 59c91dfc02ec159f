"""Every collective muon_dtensor issues lives here.

Two kinds: a small integer all-reduce for the preflight (so every rank sees every rank's input
problems before any data moves), and the all-to-all that carries matrix blocks to their owners and
back. Blocks travel in the Newton-Schulz dtype (bfloat16 by default): the owner casts to it anyway,
so sending it halves the bytes and changes no bit of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CommStats",
    "exchange_group",
    "start_all_to_all",
    "sum_over_group",
    "sum_over_mesh",
]

# (mesh ranks, mesh shape, axes) -> this rank's group over those axes
_GROUPS: dict[tuple, dist.ProcessGroup] = {}


class CommStats:
    """Bytes this rank sent to and received from other ranks, collectives issued and matrices
    this rank orthogonalized, for benchmarks and tests."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sent = self.received = self.collectives = self.orthogonalized = 0
        self.live_bytes = self.peak_bytes = 0

    def hold(self, nbytes: int) -> None:
        """Exchange buffers (sends, receives, assembled matrices) allocated; tracks the peak."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def sum_over_mesh(counts: Tensor, mesh: DeviceMesh) -> Tensor:
    """Sum an integer tensor over every rank of ``mesh``, one all-reduce per mesh axis.

    Summing axis by axis reaches every rank of the mesh without creating a new process group, and
    touches only ranks of this mesh, so a pipeline stage never waits on another stage.
    """
    out = counts.to(mesh.device_type)
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.get_group(axis))
    return out.cpu()


def sum_over_group(counts: Tensor, group: dist.ProcessGroup, device_type: str = "cpu") -> Tensor:
    out = counts.to(device_type)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out.cpu()


def exchange_group(mesh: DeviceMesh, axes: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of this rank over mesh ``axes`` (the others fixed).

    One axis is the mesh's own group. Several axes (FSDP x TP) need new groups; ``new_group`` is
    collective over the default group, so every rank creates every subgroup of the mesh, in the
    same order: call this on all ranks for the same (mesh, axes), e.g. while building the optimizer.
    """
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    key = (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape), axes)
    if key not in _GROUPS:
        others = [a for a in range(mesh.ndim) if a not in axes]
        moved = mesh.mesh.permute(*others, *axes).reshape(-1, _prod(mesh.size(a) for a in axes))
        me = dist.get_rank()
        for ranks in moved.tolist():
            group = dist.new_group(sorted(ranks))
            if me in ranks:
                _GROUPS[key] = group
    return _GROUPS[key]


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
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
    send_numels = [sum(c.numel() for c in per_dest) for per_dest in chunks]
    send = torch.empty(sum(send_numels), dtype=dtype, device=device)
    offset = 0
    for c in (c for per_dest in chunks for c in per_dest):
        # One copy straight into the send buffer (casting, and gathering strided results).
        send[offset : offset + c.numel()].view(c.shape).copy_(c)
        offset += c.numel()
    recv = torch.empty(sum(recv_numels), dtype=dtype, device=device)
    work = dist.all_to_all_single(recv, send, list(recv_numels), send_numels, group=group, async_op=True)
    item = recv.element_size()
    if stats is not None:
        me = dist.get_rank(group)
        stats.sent += (sum(send_numels) - send_numels[me]) * item
        stats.received += (sum(recv_numels) - recv_numels[me]) * item
        stats.collectives += 1
        stats.hold((send.numel() + recv.numel()) * item)

    def finish() -> list[Tensor]:
        work.wait()
        if stats is not None:
            stats.release(send.numel() * item)  # ``send`` dies here; ``recv`` lives on in views
        return list(recv.split(list(recv_numels)))

    return finish
