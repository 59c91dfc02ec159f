"""The matrices of parameters with replicas (HSDP) laid out over the whole mesh, for pricing owners
over the mesh against owners per replica (``policy.owner_meshes``). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .blocks import mesh_blocks
from .build import MatrixEntry
from .param_layout import replica_count, shards_of
from .views import matrix_views

__all__ = ["mesh_entries"]


def mesh_entries(
    params: Sequence[Tensor], mesh: DeviceMesh, view_options: Mapping[str, Any]
) -> list[MatrixEntry]:
    """The matrices of ``params`` with replicas on ``mesh``, laid out over the whole mesh (pure)."""
    entries = []
    for p in params:
        if not (isinstance(p, DTensor) and p.device_mesh == mesh and replica_count(p) > 1):
            continue
        blocks, replica_of = mesh_blocks(p.shape, tuple(mesh.shape), shards_of(p, ""))
        for view in matrix_views(p.shape, blocks, 0, name="", **view_options):
            entries.append(MatrixEntry(view.shape, view.blocks, replica_of=replica_of))
    return entries
