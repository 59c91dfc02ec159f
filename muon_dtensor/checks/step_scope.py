"""The step's scope: before any per-mesh sum, the ranks of the step group (``Muon(step_group=...)``,
by default the default group, which every rank can name) agree that every mesh one of them steps
on is stepped on by all its ranks. Without it, a rank that lacks a whole mesh its peers use never
joins that mesh's sum, and the peers wait forever.

The check is a fingerprint that travels in one integer sum over the group: each rank adds, per
scope it uses, ``h(s) * (W(s) - |s| * w_rank)`` modulo a prime, where ``w`` is a pseudo-random
weight per rank and ``W(s)`` the sum of the weights of the scope's ranks. When every rank of every
scope adds its term the total is 0; when a set of ranks that is not the whole scope adds it, the
total is not 0 but with probability 2^-31 per piece (two pieces). The first scope whose ranks are
the whole group is summed in the same row, so the usual 1-D FSDP or HSDP step keeps one all-reduce.
A pure function of the scopes and this rank; the collective is ``step_checks``'s.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.runtime.comm import fake_refusal, simulated

__all__ = ["PRIME", "StepScope", "agreed", "describe", "fingerprint", "scope_key", "shown", "step_scope"]

PRIME = (1 << 31) - 1  # pieces below 2^31: sums over 2^20 ranks stay exact in int64
_SEEDS = (b"mesh-a", b"mesh-b")


def scope_key(scope: Any) -> tuple:
    """A scope as plain data, equal on every rank that holds it: the order every rank reduces in."""
    if isinstance(scope, DeviceMesh):
        names = scope.mesh_dim_names or ()
        return (
            "mesh",
            scope.device_type,
            tuple(scope.mesh.shape),
            tuple(names),
            tuple(scope.mesh.flatten().tolist()),
        )
    return ("group", (), (), (), tuple(dist.get_process_group_ranks(scope)))


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a step group (None: the default group)."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return scope_key(group)[4]


@dataclass(frozen=True)
class StepScope:
    """What this rank adds to the step group's row, cached per parameter set."""

    joins: bool  # this rank sums over the step group (it steps on a mesh, or the group was given)
    pieces: tuple[int, ...]  # the fingerprint's terms, one per seed, each in [0, PRIME)
    folded: int | None  # the index of the scope summed in the group's row (its ranks are the group's)
    outside: str | None  # a scope reaching outside the group, or a fake one that would lie: the error


def step_scope(scopes: Sequence[Any], group: Any, explicit: bool) -> StepScope:
    """The step group's part for ``scopes`` (in reduce order) on this rank; no collective."""
    if not (dist.is_available() and dist.is_initialized()) or not (scopes or explicit):
        return StepScope(False, (), None, None)
    members, rank = group_ranks(group), dist.get_rank()
    keys = [scope_key(s) for s in scopes]
    outside = next((k for k in keys if not set(k[4]) <= set(members)), None)
    folded = next((i for i, k in enumerate(keys) if sorted(k[4]) == sorted(members)), None)
    pieces = fingerprint(keys, rank)
    why = _fake_scope(scopes, group)
    if why is None and simulated(group):  # every rank of a fake world is this one: the sum is 0
        pieces = (0,) * len(_SEEDS)
    if why is None and outside is not None:
        why = (
            f"a parameter lives on {_shown(outside)}, which reaches ranks outside the step group "
            f"(ranks {list(members)}); pass Muon(step_group=...) a group holding every rank of its meshes"
        )
    return StepScope(True, pieces, folded, why)


def _fake_scope(scopes: Sequence[Any], group: Any) -> str | None:
    """The refusal of a fake step group, mesh axis or DDP group of more than one rank in a real job
    (``comm.fake_refusal``): its sums would lie, so it travels as this rank's local failure."""
    named = [
        (group, "step_group"),
        *((s, "a parameter's mesh" if isinstance(s, DeviceMesh) else "process_group") for s in scopes),
    ]
    return next((r for scope, name in named if (r := fake_refusal(scope, name)) is not None), None)


def fingerprint(keys: Sequence[tuple], rank: int) -> tuple[int, ...]:
    """This rank's terms for the scopes ``keys`` (``scope_key``s), one per seed: summed over every
    rank, 0 modulo ``PRIME`` when each key was added by exactly the ranks it lists."""
    return tuple(sum(_term(k, rank, seed) for k in keys) % PRIME for seed in _SEEDS)


def shown(key: tuple) -> str:
    """A scope key in words, for errors."""
    return _shown(key)


def agreed(sums: Sequence[int]) -> bool:
    """Whether the summed fingerprint pieces say every rank of every scope steps on it."""
    return all(s % PRIME == 0 for s in sums)


def describe(everyone: dict[int, list[tuple]]) -> str:
    """From every rank's scope keys: which ranks lack a mesh their peers step on."""
    holders: dict[tuple, list[int]] = {}
    for rank, keys in sorted(everyone.items()):
        for k in keys:
            holders.setdefault(k, []).append(rank)
    parts = [
        f"{_shown(k)} is stepped on by rank(s) {ranks} but not by {sorted(set(k[4]) - set(ranks))}"
        for k, ranks in holders.items()
        if sorted(ranks) != sorted(k[4])
    ]
    return "; ".join(parts) or "their meshes"


def _term(key: tuple, rank: int, seed: bytes) -> int:
    total, size = _scope_weight(key, seed), len(key[4])
    return _hash(repr(key).encode(), seed) * (total - size * _weight(rank, seed)) % PRIME


@functools.lru_cache(maxsize=256)
def _scope_weight(key: tuple, seed: bytes) -> int:
    return sum(_weight(r, seed) for r in key[4])


@functools.lru_cache(maxsize=1 << 14)
def _weight(rank: int, seed: bytes) -> int:
    return _hash(str(rank).encode(), seed + b"w")


def _hash(data: bytes, seed: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=seed).digest(), "big") % PRIME


def _shown(key: tuple) -> str:
    kind, device, shape, names, ranks = key
    if kind == "group":
        return f"the process group of ranks {list(ranks)}"
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, shape)) if names else "x".join(map(str, shape))
    return f"the {device} mesh ({dims}) of ranks {list(ranks)}"
