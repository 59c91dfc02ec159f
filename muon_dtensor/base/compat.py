"""Version-tolerant access to the private torch.distributed names muon_dtensor relies on (the
tensor-level ones, ``torch._foreach_*``, are ``torch_ops.py``'s).

Each private name is looked up here and nowhere else (``tests/base/test_private_torch.py`` holds the
package to it), in every place torch has kept it across the releases listed in
docs/compatibility.md, so a move in a new torch release is fixed in one file. A name found in none
of them raises an ImportError that names the torch version and the places tried, at import time
(``_StridedShard``) or at first use (``flatten_state_dict``, the checkpoint records).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import distributed_c10d as c10d

__all__ = [
    "StridedShard",
    "_StridedShard",
    "capturable_devices",
    "dcp_records",
    "default_group",
    "default_store",
    "dtensor_spec",
    "flatten_state_dict",
    "has_cpu_backend",
    "is_fsdp1_flat_param",
    "local_tensor",
    "non_persistent_buffers",
]


def _find(name: str, modules: tuple[str, ...]) -> Any:
    """The first ``module.name`` that imports, in the order given."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(
        f"muon_dtensor: torch {torch.__version__} has no {name} in {', '.join(modules)}; "
        "see docs/compatibility.md for the torch releases muon_dtensor is tested with"
    )


# DTensor's interleaved shard (FSDP2 over tensor parallel). In torch 2.9 a Python subclass of Shard,
# in 2.13 a subclass of the C++ ``torch._C._distributed.StridedShard`` (not of Shard); in
# ``placement_types`` in both, and re-exported by ``torch.distributed.tensor`` in 2.13 (not 2.9).
# Callers test ``isinstance(p, _StridedShard)`` before ``type(p) is Shard``, which holds in both.
_STRIDED_SHARD_MODULES = ("torch.distributed.tensor.placement_types", "torch.distributed.tensor")

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import _StridedShard
else:
    _StridedShard = _find("_StridedShard", _STRIDED_SHARD_MODULES)
# The name the package's modules use (a private name outside this folder is refused).
StridedShard = _StridedShard


# DCP's nested-dict flattening, the key mapping dcp.save and dcp.load use for nested state dicts.
_FLATTEN_MODULES = ("torch.distributed.checkpoint._nested_dict",)


def flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: (flat dict, key mapping)."""
    flatten: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]] = _find(
        "flatten_state_dict", _FLATTEN_MODULES
    )
    return flatten(state)


def has_cpu_backend(group: torch.distributed.ProcessGroup) -> bool:
    """Whether ``group`` can run a collective on CPU tensors (``ProcessGroup._device_types``, the
    devices its backends serve; read by torch's own state-dict utilities since 2.3)."""
    types = getattr(group, "_device_types", None)
    return types is not None and any(d.type == "cpu" for d in types)


def local_tensor(t: Any) -> torch.Tensor:
    """A DTensor's local tensor itself (``DTensor._local_tensor``). ``to_local()`` returns a view
    through an autograd Function, about 10 us a call: the preflight and the step read every
    parameter's, gradient's and state's local tensor, so with thousands of parameters that cost
    dominated the preflight. Same storage either way; the step runs under ``no_grad``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


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
