"""Private torch.distributed, DCP, optimizer and module names the package reads, each behind one
function here (tests/base/test_private_torch.py refuses them anywhere outside ``base/``): the
default group and store, a DTensor's spec, the devices torch captures optimizer steps on, a
module's non-persistent buffers, FSDP1's flat parameter and the records of a DCP metadata pickle.
The tensor-level ones (``torch._foreach_*``) are ``torch_ops.py``'s, the version-tolerant lookups
``compat.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

from .compat import _find

__all__ = [
    "capturable_devices",
    "dcp_records",
    "default_group",
    "default_store",
    "dtensor_spec",
    "fake_store",
    "is_fsdp1_flat_param",
    "local_shape",
    "named_group",
    "non_persistent_buffers",
    "process_group_count",
]


def dtensor_spec(t: Any) -> Any:
    """A DTensor's spec (``DTensor._spec``: mesh, placements, shape) or None for any other tensor.
    FSDP2 builds a gradient with its parameter's own spec object, so ``is`` compares layouts in a
    step's steady state without building placements."""
    return getattr(t, "_spec", None)


def default_group() -> torch.distributed.ProcessGroup:
    """The default process group (``distributed_c10d._get_default_group``)."""
    return c10d._get_default_group()


def default_store() -> torch.distributed.Store:
    """The default group's store (``distributed_c10d._get_default_store``)."""
    return c10d._get_default_store()


def capturable_devices() -> list[str]:
    """The device types torch captures CUDA graphs of optimizer steps on
    (``torch.optim.optimizer._get_capturable_supported_devices``)."""
    devices: list[str] = _find("_get_capturable_supported_devices", ("torch.optim.optimizer",))()
    return devices


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """The names of a module's buffers ``state_dict`` leaves out (``Module._non_persistent_buffers_set``)."""
    names: set[str] = module._non_persistent_buffers_set
    return names


def is_fsdp1_flat_param(p: Any) -> bool:
    """FSDP1's flattened parameter (``FlatParameter``, marked ``_is_flat_param``)."""
    return type(p).__name__ == "FlatParameter" or bool(getattr(p, "_is_flat_param", False))


def dcp_records() -> tuple[type, type, Callable[..., Any]]:
    """The private names a DCP ``.metadata`` pickle refers to: ``filesystem._StorageInfo``,
    ``metadata._MEM_FORMAT_ENCODING`` and ``serialization._get_layout`` (``checkpoint/safe_read.py``
    allows these, each under the module its pickle records, and no more)."""
    return (
        _find("_StorageInfo", ("torch.distributed.checkpoint.filesystem",)),
        _find("_MEM_FORMAT_ENCODING", ("torch.distributed.checkpoint.metadata",)),
        _find("_get_layout", ("torch.serialization",)),
    )


def fake_store() -> torch.distributed.Store:
    """A store for torch's ``fake`` backend, one rank of a simulated world
    (``torch.testing._internal.distributed.fake_pg.FakeStore``)."""
    store: torch.distributed.Store = _find("FakeStore", ("torch.testing._internal.distributed.fake_pg",))()
    return store


def local_shape(shape: torch.Size, mesh: Any, placements: Any) -> tuple[int, ...]:
    """This rank's shard shape of a global ``shape`` laid out by ``placements`` on ``mesh``
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    find = _find("compute_local_shape_and_global_offset", ("torch.distributed.tensor._utils",))
    return tuple(find(shape, mesh, placements)[0])


def process_group_count() -> int:
    """How many process groups this process has created (``distributed_c10d._world.pg_map``)."""
    return len(c10d._world.pg_map)


def named_group(ranks: list[int], name: str, backend: str | None = None) -> torch.distributed.ProcessGroup:
    """A process group over ``ranks`` (global ranks, sorted, this rank among them) created by those
    ranks alone under ``name``: its store prefix, so members meet there whatever other groups each
    of them made before. ``new_group(use_local_synchronization=True)`` names a group from this rank's
    own count of groups, which ranks with different histories do not share. Built as ``new_group``
    builds one (``distributed_c10d._new_process_group_helper``, then the rank map); ``backend``:
    the default group's when None."""
    default = c10d._get_default_group()
    default_backend, store = c10d._world.pg_map[default]
    chosen = c10d.Backend(backend or default_backend)
    pg, _ = c10d._new_process_group_helper(
        len(ranks),
        ranks.index(default.rank()),
        ranks,
        chosen,
        store,
        c10d.GroupName(name),
        timeout=c10d._get_default_timeout(chosen),
        device_id=default.bound_device_id,
        group_desc=name,
    )
    c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg
