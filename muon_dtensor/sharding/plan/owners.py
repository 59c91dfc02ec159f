"""The matrices of parameters with replicas (HSDP) laid out over the whole mesh, for pricing owners
over the mesh against owners per replica (``policy.owner_meshes``). Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from .blocks import mesh_blocks
from .build import MatrixEntry
from .param_layout import LayoutRecord
from .views import matrix_views

__all__ = ["mesh_entries"]


def mesh_entries(
    records: Sequence[LayoutRecord], mesh: DeviceMesh, view_options: Mapping[str, Any]
) -> list[MatrixEntry]:
    """The matrices of the parameters (their ``records``) with replicas on ``mesh``, laid out over
    the whole mesh (pure)."""
    entries = []
    for record in records:
        if not (record.mesh == mesh and record.replicas > 1):
            continue
        blocks, replica_of = mesh_blocks(record.shape, record.mesh_shape, record.shards)
        for view in matrix_views(record.shape, blocks, 0, name="", **view_options):
            entries.append(MatrixEntry(view.shape, view.blocks, replica_of=replica_of))
    return entries
