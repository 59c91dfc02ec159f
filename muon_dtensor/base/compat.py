"""Version-tolerant imports of the private torch APIs muon_dtensor relies on.

Each private name is looked up here or beside it in ``base/`` and nowhere else
(tests/base/test_private_torch.py), in every place torch has kept it across the
releases listed in docs/compatibility.md, so a move in a new torch release is fixed in one file.
A name found in none of them raises an ImportError that names the torch version and the places
tried, at import time (``_StridedShard``) or at first use (``flatten_state_dict``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

__all__ = [
    "StridedShard",
    "TorchDispatchMode",
    "_StridedShard",
    "all_gather_single",
    "flatten_state_dict",
    "has_cpu_backend",
    "local_tensor",
    "tree_leaves",
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
StridedShard = _StridedShard  # the name the package uses (a private name outside base/ is refused)


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


# The dispatch mode ``plan --rehearse`` records its step's collectives with, and pytree's leaves of
# an op's arguments (``torch.utils._python_dispatch``, ``torch.utils._pytree``, in 2.9 and 2.13).
if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
else:
    TorchDispatchMode = _find("TorchDispatchMode", ("torch.utils._python_dispatch",))
    tree_leaves = _find("tree_leaves", ("torch.utils._pytree",))


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """Every rank's ``input`` into one tensor: ``dist.all_gather_single`` where torch has it (2.13,
    which deprecates the older name), else ``dist.all_gather_into_tensor``."""
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)
