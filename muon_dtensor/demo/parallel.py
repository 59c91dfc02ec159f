"""Device meshes and sharding for the demo and ``examples/train.py``: FSDP2, HSDP and FSDP x TP.

- ``fsdp``: a 1-D mesh ``("dp",)``; every block and the root are ``fully_shard``-ed on it.
- ``hsdp``: a 2-D mesh ``("replicate", "shard")``; parameters are ``(Replicate(), Shard(0))``.
- ``fsdp-tp``: a 2-D mesh ``("dp", "tp")``; ``parallelize_module`` shards each block's matrices on
  ``tp`` (``ColwiseParallel`` for q, k, v, up; ``RowwiseParallel`` for proj, down), then
  ``fully_shard`` shards them on ``dp`` along the *other* matrix dimension, so every matrix is a
  clean 2-D block grid (no ``_StridedShard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = [
    "LAYOUTS",
    "MeshShape",
    "build_mesh",
    "data_parallel",
    "demo_shape",
    "device_type",
    "layout_problem",
    "shard_model",
]

LAYOUTS = ("fsdp", "hsdp", "fsdp-tp")

# Column-parallel: output features split over tp ranks (heads for q, k, v). Row-parallel: input
# features split, outputs summed. The usual Megatron pairing for attention and MLP.
_TP_PLAN = {
    "q": ColwiseParallel(),
    "k": ColwiseParallel(),
    "v": ColwiseParallel(),
    "proj": RowwiseParallel(),
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
}


@dataclass(frozen=True)
class MeshShape:
    """``dp`` data-parallel ranks (``replicas`` HSDP replica groups among them) times ``tp``."""

    dp: int
    tp: int = 1
    replicas: int = 1
    hsdp: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def describe(self) -> str:
        if self.tp > 1:
            return f"FSDP x TP, mesh (dp={self.dp}, tp={self.tp})"
        if self.hsdp:
            return f"HSDP, mesh (replicate={self.replicas}, shard={self.dp // self.replicas})"
        return f"FSDP2, mesh (dp={self.dp},)"


def demo_shape(layout: str, world: int) -> MeshShape:
    """The demo's mesh for ``layout`` on ``world`` ranks."""
    if layout == "fsdp":
        return MeshShape(dp=world)
    if layout == "hsdp":
        replicas = 2 if world % 2 == 0 and world >= 4 else 1
        return MeshShape(dp=world, replicas=replicas, hsdp=True)
    if layout == "fsdp-tp":
        tp = 2 if world % 2 == 0 else 1
        return MeshShape(dp=world // tp, tp=tp)
    raise ValueError(f"layout should be one of {LAYOUTS} but is: {layout!r}")


def layout_problem(layout: str, world: int) -> str | None:
    """Why ``layout`` on ``world`` ranks would silently be another layout (the demo refuses it), or
    None. HSDP needs 2 replica groups of at least 2 shards; FSDP x TP needs tp=2."""
    if layout == "hsdp" and (world < 4 or world % 2):
        return (
            f"--layout hsdp needs an even --world-size of at least 4 (2 replica groups of at least 2 shards), "
            f"but --world-size is {world}: that would be replicate=1, plain FSDP. Use --world-size 4 "
            f"(or 6, 8, ...), or --layout fsdp for {world} rank(s)"
        )
    if layout == "fsdp-tp" and world % 2:
        return (
            f"--layout fsdp-tp needs an even --world-size (tensor parallel over 2 ranks), but --world-size is "
            f"{world}: that would be tp=1, plain FSDP. Use --world-size {world + 1}, or --layout fsdp"
        )
    return None


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(shape: MeshShape) -> DeviceMesh:
    """The mesh for ``shape``; collective over every rank, whose count must be ``shape.world``."""
    if shape.world != dist.get_world_size():
        raise ValueError(
            f"dp x tp should equal the world size but is {shape.dp} x {shape.tp} on {dist.get_world_size()} ranks"
        )
    if shape.dp % shape.replicas:
        raise ValueError(
            f"dp should be a multiple of replicas but dp is {shape.dp} and replicas {shape.replicas}"
        )
    device = device_type()
    if shape.tp > 1:
        return init_device_mesh(device, (shape.dp, shape.tp), mesh_dim_names=("dp", "tp"))
    if shape.hsdp or shape.replicas > 1:
        dims = (shape.replicas, shape.dp // shape.replicas)
        return init_device_mesh(device, dims, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device, (shape.dp,), mesh_dim_names=("dp",))


def _other_matrix_dim(p: nn.Parameter) -> Shard | None:
    """FSDP's placement for a tensor-parallel matrix: the dimension tp does not shard."""
    if isinstance(p, DTensor) and p.ndim == 2:
        for placement in p.placements:
            if isinstance(placement, Shard):
                return Shard(1 - placement.dim % 2)
    return None


def shard_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply tensor parallelism (if the mesh has a ``tp`` axis), then FSDP2 to every block and the root."""
    names = mesh.mesh_dim_names or ()
    dp_mesh = mesh
    placement_fn = None
    blocks = model.get_submodule("blocks")  # TinyLM's nn.ModuleList of transformer blocks
    if "tp" in names:
        for block in blocks.children():
            parallelize_module(block, mesh["tp"], _TP_PLAN)
        dp_mesh, placement_fn = mesh["dp"], _other_matrix_dim
    for block in blocks.children():
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement_fn)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=placement_fn)


def data_parallel(mesh: DeviceMesh) -> tuple[int, int, dist.ProcessGroup | None]:
    """(this rank's data-parallel index, data-parallel size, group): ranks that see different data.

    Every rank is a data-parallel rank except under tensor parallelism, where the ranks of one ``tp``
    group see the same batch.
    """
    if "tp" in (mesh.mesh_dim_names or ()):
        dp = mesh["dp"]
        return dp.get_local_rank(), dp.size(), dp.get_group()
    return dist.get_rank(), dist.get_world_size(), None
