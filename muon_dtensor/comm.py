"""Every collective muon_dtensor issues lives here.

Two kinds: a small integer all-reduce for the preflight (so every rank sees every rank's input
problems before any data moves), and the all-to-all that carries matrix blocks to their owners and
back. Blocks travel in the Newton-Schulz dtype (bfloat16 by default): the owner casts to it anyway,
so sending it halves the bytes and changes no bit of the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CommStats", "all_to_all_chunks", "sum_over_mesh"]


class CommStats:
    """Bytes this rank sent to and received from other ranks, for benchmarks and tests."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.collectives = 0

    def reset(self) -> None:
        self.sent = self.received = self.collectives = 0


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


def all_to_all_chunks(
    chunks: Sequence[Sequence[Tensor]],
    recv_numels: Sequence[int],
    *,
    group: dist.ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
) -> list[Tensor]:
    """Send ``chunks[d]`` (flattened, concatenated) to group rank ``d``; return what each rank sent.

    ``recv_numels[s]`` is how many elements group rank ``s`` sends here; every rank knows it from
    the plan, so no size exchange precedes the data.
    """
    send_numels = [sum(c.numel() for c in per_dest) for per_dest in chunks]
    flat = [c.reshape(-1).to(dtype) for per_dest in chunks for c in per_dest]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_numels), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, list(recv_numels), send_numels, group=group)
    if stats is not None:
        me = dist.get_rank(group)
        item = recv.element_size()
        stats.sent += (sum(send_numels) - send_numels[me]) * item
        stats.received += (sum(recv_numels) - recv_numels[me]) * item
        stats.collectives += 1
    return list(recv.split(list(recv_numels)))
