"""Which ranks hold each FQN of a save, checked before anything is written.

DCP keeps one tensor per key. That is right for the ranks of one parameter: the shards of a
DTensor on one mesh (FSDP, HSDP, TP), or a plain parameter replicated over data-parallel ranks.
It loses data when the same FQN names different tensors on different ranks: two pipeline stages
built with local names (each stage's ``blocks.0``), plain or sharded on per-stage meshes. The save
would keep one stage's weights and momentum under both, and a load would give stage 1 stage 0's.

Each rank describes every model entry it saves: a DTensor by its mesh (global ranks), placements,
global shape and dtype; a plain parameter by its shape, dtype and a fingerprint of its values and
of its optimizer state (replicas are bit for bit alike in both: two pipeline stages with equal
weights, as after a first step at lr 0, differ in their momentum); a plain buffer by its shape and dtype (FSDP leaves buffers such
as running statistics per rank). An FQN whose holders describe it alike is one tensor. One
integer sum over the group compares the ranks' digests; only where they differ (pipeline stages
hold different FQNs) does an object gather bring every rank's descriptions, and every rank then
reaches the same verdict from the same data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..checks.together import digest_pieces, disagree, group_of, summed
from ..sharding.runtime.comm import gather_over_scope
from .keys import Parts

__all__ = ["check_holders", "describe_entries"]

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _param_fqns(parts: Parts) -> set[str]:
    """The FQNs of the parts' parameters as a state dict names them (wrapper prefixes removed)."""
    out = set()
    for model in parts.models:
        for name, _ in model.named_parameters():
            for wrapper in _WRAPPERS:
                name = name.replace(wrapper, "")
            out.add(name.removeprefix("module.") if hasattr(model, "module") else name)
    return out


def describe_entries(state: Mapping[str, Any], parts: Parts) -> dict[str, str]:
    """Per model entry of a format-2 state dict, what makes it one tensor across ranks; a plain
    parameter's optimizer entries (momentum, ...) join its values' fingerprint, so two stages with
    equal weights and different momentum differ. Local; reads the fingerprints in one host copy."""
    params = _param_fqns(parts)
    optimizer = _optimizer_tensors(state.get("optimizer", {}), params)
    out: dict[str, str] = {}
    fingerprinted: list[tuple[str, str, Tensor]] = []
    for key, value in state.items():
        if key == "optimizer" or not isinstance(value, Tensor):
            continue
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            ranks = mesh.mesh.flatten().tolist()
            out[key] = (
                f"DTensor {tuple(value.shape)} {value.dtype} {value.placements} on the mesh of ranks {ranks}"
            )
        else:
            out[key] = f"tensor {tuple(value.shape)} {value.dtype}"
            if key in params:
                fingerprinted += [(key, "values", value), *((key, k, t) for k, t in optimizer.get(key, []))]
    fingerprinted = [(key, what, t) for key, what, t in fingerprinted if t.numel()]
    if fingerprinted:
        sums = torch.stack([_fingerprint(t) for *_, t in fingerprinted]).cpu().tolist()
        for (key, what, _), (a, b) in zip(fingerprinted, sums):
            out[key] += f" with {what} {a!r}/{b!r}"
    return out


def _optimizer_tensors(optim: Mapping[str, Any], params: set[str]) -> dict[str, list[tuple[str, Tensor]]]:
    """Per plain parameter FQN, its optimizer state's plain tensors (``state.<fqn>.<key>``) as
    (key, tensor), in key order. The FQN is the longest dotted prefix that names a parameter."""
    out: dict[str, list[tuple[str, Tensor]]] = {}
    for key, value in sorted(optim.items()):
        if not key.startswith("state.") or not isinstance(value, Tensor) or isinstance(value, DTensor):
            continue
        names = key.removeprefix("state.").split(".")
        cut = next((i for i in range(len(names) - 1, 0, -1) if ".".join(names[:i]) in params), None)
        if cut is not None:
            out.setdefault(".".join(names[:cut]), []).append((".".join(names[cut:]), value))
    return out


def _fingerprint(t: Tensor) -> Tensor:
    """Two float64 sums of the values (plain and position-weighted): equal for bitwise replicas,
    different for the weights of two stages."""
    x = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), (x * weights).sum()])


def check_holders(described: dict[str, str], group: dist.ProcessGroup | None, call: str) -> None:
    """Collective over ``group``: a ValueError on every rank, naming the FQN and the ranks, when
    some FQN is held by ranks that describe it differently (not replicas of one tensor)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    pieces = digest_pieces(repr(sorted(described.items())))
    ((sums, size),) = summed([*pieces, *(x * x for x in pieces)], [group_of(group)])
    if not disagree(size, sums[:3], sums[3:]):
        return
    everyone = gather_over_scope(described, group_of(group))
    clash = _first_clash(everyone)
    if clash is not None:
        fqn, kinds = clash
        held = "; ".join(f"rank(s) {ranks}: {kind}" for kind, ranks in kinds.items())
        raise ValueError(
            f"{call}: {fqn!r} is held by ranks that are not replicas of one mesh ({held}). A checkpoint "
            "keeps one tensor per FQN, so one rank's state would overwrite the other's. Give each "
            "pipeline stage's modules their global FQNs (as torchtitan's pipeline split and "
            "examples/pipeline.py do), or save each stage under its own root with its own group. "
            "Nothing was saved"
        )


def _first_clash(everyone: Mapping[int, Mapping[str, str]]) -> tuple[str, dict[str, list[int]]] | None:
    kinds: dict[str, dict[str, list[int]]] = {}
    for rank, described in sorted(everyone.items()):
        for fqn, kind in described.items():
            kinds.setdefault(fqn, {}).setdefault(kind, []).append(rank)
    return next(((fqn, k) for fqn, k in sorted(kinds.items()) if len(k) > 1), None)
