"""The optimizer's ``"auto"`` answers, priced by the cost model (``planning``): where HSDP
parameters find their owners (``owners``) and which matrices run Newton-Schulz over several ranks
(``ns_split``). The plan layer below takes the answers only, as plain meshes and rank counts.

``owners``: with R replicas of S shards, owners per replica (``"replica"``) orthogonalize every
matrix in every replica: R times the Newton-Schulz work of the mesh, and no bytes between replicas.
Owners over the mesh (``"mesh"``) orthogonalize each matrix once among all R x S ranks, and send
M (R - 1) / (R S) bytes per rank across replicas for matrices of M bytes (``planning/traffic.py``).
``"auto"`` prices both on the mesh's own layout; the answer decides which process groups exist, so
it ends in one small all-reduce per mesh: owners over the mesh only where every rank votes for them.

``ns_split``: ``"off"`` (default) splits nothing, so every step equals the one-process step
bitwise. An integer k: every matrix whose long side has at least k elements, over min(k, the
exchange group's ranks) ranks. ``"auto"``: a k per shape from ``planning/split.plan_splits``, taken
only where it shortens the busiest rank's modelled time. That choice depends only on global shapes,
the group's size and the node size, so every rank of a group makes the same one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..planning.costmodel import compare_owners
from ..planning.hardware import Hardware
from ..planning.split import plan_splits
from ..sharding.plan.owners import mesh_entries
from ..sharding.plan.param_layout import LayoutRecord
from ..sharding.runtime.comm import sum_over_mesh

__all__ = ["OwnerChoice", "SplitPolicy", "node_size", "owner_meshes", "split_policy"]


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


@dataclass(frozen=True)
class OwnerChoice:
    """Where the parameters with replicas (HSDP) of one mesh find their owners, and why: the group's
    ``owners`` setting, the answer, and for ``"auto"`` this rank's modelled step with owners over
    the mesh and per replica (H200 figures, ``node_size`` ranks per node, the default rounds)."""

    mesh_shape: tuple[int, ...]
    setting: str
    over_mesh: bool
    prices: tuple[float, float] | None = None  # seconds: (owners over the mesh, per replica)
    node_size: int = 1

    def describe(self) -> str:
        """One line, e.g. ``mesh 8 x 128: owners over the mesh (owners='auto': 12.3 ms against
        15.6 ms per replica, H200 model, 8 ranks per node)``."""
        where = "owners over the mesh" if self.over_mesh else "owners per replica"
        shape = " x ".join(str(s) for s in self.mesh_shape)
        if self.prices is None:
            return f"mesh {shape}: {where} (owners={self.setting!r})"
        mesh, replica = (f"{t * 1e3:.2f} ms" for t in self.prices)
        why = f"{mesh} over the mesh, {replica} per replica"
        vote = "" if self.over_mesh == (self.prices[0] < self.prices[1]) else "; another rank voted otherwise"
        return (
            f"mesh {shape}: {where} (owners='auto': modelled step {why}, H200, "
            f"{self.node_size} ranks per node{vote})"
        )


def _mesh_pays(
    records: Sequence[LayoutRecord],
    mesh: DeviceMesh,
    view_options: Mapping[str, Any],
    prices: dict[DeviceMesh, tuple[float, float]],
) -> bool:
    """Whether the cost model predicts a shorter step with owners over ``mesh`` than per replica
    (H200 figures, the default exchange rounds, this node size); the two prices go in ``prices``."""
    try:
        entries = mesh_entries(records, mesh, view_options)
    except ValueError:
        return False  # layout_of raises the same error on every rank, naming the parameter
    per_node = node_size(mesh.device_type)
    nodes = [r // per_node for r in mesh.mesh.reshape(-1).tolist()]
    hw = Hardware.h200(gpus_per_node=per_node)
    times = compare_owners(entries, nodes, hw)
    prices[mesh] = (times["mesh"], times["replica"])
    return times["mesh"] < times["replica"]


def owner_meshes(
    records: Sequence[LayoutRecord], owners: str, view_options: Mapping[str, Any]
) -> tuple[frozenset[DeviceMesh], list[OwnerChoice]]:
    """The meshes on which parameters with replicas (their ``records``, read on meshes this rank is
    part of) take owners over the whole mesh, and per mesh the choice and why (``OwnerChoice``).
    Collective for ``owners="auto"`` (one 2-integer all-reduce per mesh axis, for each such mesh):
    every rank of a mesh gets the same answer even if their node sizes differ."""
    meshes = [mesh for mesh in dict.fromkeys(r.mesh for r in records if r.replicas > 1) if mesh is not None]
    if owners != "auto":
        fixed = meshes if owners == "mesh" else []
        return frozenset(fixed), [OwnerChoice(tuple(m.shape), owners, m in fixed) for m in meshes]
    chosen: list[DeviceMesh] = []
    prices: dict[DeviceMesh, tuple[float, float]] = {}
    # A mesh of fewer ranks than the world (a pipeline stage's) votes among its own ranks, and its
    # exchange group is created by them alone (``groups.exchange_group``), so other stages never wait.
    for mesh in meshes:
        vote = torch.tensor([1, int(_mesh_pays(records, mesh, view_options, prices))])
        ranks, yes = (int(v) for v in sum_over_mesh(vote, mesh))
        if yes == ranks:
            chosen.append(mesh)
    per_node = {m: node_size(m.device_type) for m in meshes}
    choices = [OwnerChoice(tuple(m.shape), "auto", m in chosen, prices.get(m), per_node[m]) for m in meshes]
    return frozenset(chosen), choices


@dataclass(frozen=True)
class SplitPolicy:
    setting: str | int = "off"
    ns_steps: int = 5
    itemsize: int = 2
    node_size: int = 8

    @classmethod
    def of(cls, group: Mapping[str, Any], node_size: int) -> SplitPolicy:
        """A group's policy. Splits run the standard iteration on matrices without NorMuon's
        columns, in owner mode: elsewhere ``"auto"`` splits nothing (validation refuses an int)."""
        setting = group.get("ns_split", "off")  # absent from groups saved before it existed
        plain = not group.get("normuon", False) and group.get("ns_algorithm", "standard") == "standard"
        if not plain or group.get("mode", "owner") != "owner":
            setting = "off"
        itemsize = 2 if group.get("ns_dtype", "bfloat16") == "bfloat16" else 4
        return cls(setting, int(group.get("ns_steps", 5)), itemsize, node_size)

    def ks(self, shapes: Sequence[tuple[int, int]], group_size: int) -> list[int]:
        """Ranks per matrix (1: not split) for ``shapes``, in a group of ``group_size`` ranks."""
        if self.setting == "off" or group_size < 2 or not shapes:
            return [1] * len(shapes)
        if isinstance(self.setting, int):
            k = min(self.setting, group_size)
            return [k if max(s) >= k else 1 for s in shapes]
        hw = Hardware.h200(gpus_per_node=self.node_size)
        plan = plan_splits(shapes, group_size, hw, ns_steps=self.ns_steps, itemsize=self.itemsize)
        return list(plan.ks)


def split_policy(group: Mapping[str, Any]) -> SplitPolicy:
    """A Muon group's ``ns_split`` policy, with this job's node size for ``"auto"``'s cost model."""
    if group.get("ns_split", "off") != "auto":
        return SplitPolicy.of(group, 1)
    device = group["params"][0].device.type if group["params"] else "cpu"
    return SplitPolicy.of(group, node_size(device))
