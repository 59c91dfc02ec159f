"""Where the matrices of a parameter with replicas (HSDP) find their owners: in each replica, or once
over the whole mesh.

With R replicas of S shards, owners per replica (``"replica"``) orthogonalize every matrix in every
replica: R times the Newton-Schulz work of the mesh, and no bytes between replicas. Owners over the
mesh (``"mesh"``) orthogonalize each matrix once among all R x S ranks: an owner reads the blocks
of its own replica and sends the result to every rank, M (R - 1) / (R S) bytes per rank across
replicas for matrices of M bytes (``traffic.py``). ``"auto"`` prices both with the cost model on the
mesh's own layout and picks per mesh. The answer must be the same on every rank (it decides which
process groups exist), so ``"auto"`` ends in one small all-reduce per mesh: owners over the mesh
only where every rank of it votes for them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..planning.costmodel import compare_owners
from ..planning.hardware import Hardware
from .blocks import mesh_blocks
from .comm import sum_over_mesh
from .param_layout import replica_count, shards_of
from .plan import MatrixEntry
from .views import matrix_views

__all__ = ["across_replicas", "mesh_entries", "node_size"]


def node_size(device_type: str) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``; else the CUDA device count for CUDA
    tensors; else (CPU) every rank on one node."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return int(local)
    if not dist.is_initialized():
        return 1
    if device_type == "cuda" and torch.cuda.is_available():
        return max(torch.cuda.device_count(), 1)
    return dist.get_world_size()


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


def _mesh_pays(params: Sequence[Tensor], mesh: DeviceMesh, view_options: Mapping[str, Any]) -> bool:
    """Whether the cost model predicts a shorter step with owners over ``mesh`` than per replica
    (H200 figures, the default exchange rounds, this node size)."""
    try:
        entries = mesh_entries(params, mesh, view_options)
    except ValueError:
        return False  # layout_of raises the same error on every rank, naming the parameter
    per_node = node_size(mesh.device_type)
    nodes = [r // per_node for r in mesh.mesh.reshape(-1).tolist()]
    hw = Hardware.h200(gpus_per_node=per_node)
    times = compare_owners(entries, nodes, hw)
    return times["mesh"] < times["replica"]


def across_replicas(
    params: Sequence[Tensor], owners: str, view_options: Mapping[str, Any]
) -> frozenset[DeviceMesh]:
    """The meshes on which parameters with replicas take owners over the whole mesh. Collective for
    ``owners="auto"`` (one 2-integer all-reduce per mesh axis, for each such mesh): every rank of
    a mesh gets the same answer even if their node sizes differ."""
    hsdp = [p for p in params if isinstance(p, DTensor) and replica_count(p) > 1]
    meshes = [
        mesh for mesh in dict.fromkeys(p.device_mesh for p in hsdp) if mesh.get_coordinate() is not None
    ]
    if owners == "replica" or not meshes:
        return frozenset()
    if owners == "mesh":
        return frozenset(meshes)
    chosen = []
    # "auto" stays within meshes of every rank: their exchange group is the default group. A mesh of
    # fewer ranks (a pipeline stage's) would need a new group, collective over every rank, and the
    # other stages do not build it: forcing "mesh" there asks every rank to build the same optimizer.
    for mesh in (m for m in meshes if m.size() == dist.get_world_size()):
        vote = torch.tensor([1, int(_mesh_pays(params, mesh, view_options))])
        ranks, yes = (int(v) for v in sum_over_mesh(vote, mesh))
        if yes == ranks:
            chosen.append(mesh)
    return frozenset(chosen)
