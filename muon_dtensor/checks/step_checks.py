"""Everything a step must know before data moves, in one small all-reduce per scope (per mesh
axis; per DDP group), after one over the step group that checks every rank of each mesh steps on it
(``step_scope.py``) and carries the scope spanning the group: whether the ranks built the optimizer
alike (the agreement's digest), whether any rank's values fail the local checks, and which
parameters have a gradient, a sparse one or one laid out unlike the parameter (the preflight's flags).

The order is what keeps every rank together: the local checks run and are caught, their failure
travels in the step group's row, and only then does any rank raise, the same error on every rank.
A value one rank alone changed after construction is a disagreement (explained first: a failed
check may follow from it); a bad value set on every rank is the local check's error, raised
everywhere. Scopes reduce in one sorted order on every rank.

What does not change between steady steps is cached by parameter identity: the hash of the
parameter rows, the names and the scopes; each group's checked settings are kept until one of its
values changes (``settings_cache.py``). A step then compares each group's settings key, hashes the
settings (an lr schedule changes lr) and builds the per-rank flags. Each new parameter set bumps
``generation``, which the optimizer's plan and state caches compare instead of building keys of their own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.names import param_names
from ..numerics.newton_schulz import NSConfig
from ..sharding.runtime.comm import gather_over_scope, sum_over_scopes
from .agreement import all_params, explain, scope_entries, settings_of
from .param_checks import check_switched
from .preflight import PreflightItem, local_flags, presence, raise_for, specs_of
from .settings_cache import Resolved, SettingsCache
from .step_scope import StepScope, agreed, describe, scope_key, step_scope
from .together import digest_pieces, disagree, group_of, summed

__all__ = ["StepChecks"]


@dataclass(frozen=True)
class _ParamSetCache:
    """What the checks keep between steps while the parameter set is the same."""

    scopes: tuple[Any, ...]  # sorted by ``scope_key``: the order every rank reduces in
    params: tuple[str, ...]  # per scope: a hash of its groups' (name, layout) rows and every parameter's
    members: tuple[tuple[int, ...], ...]  # per scope: the groups with parameters there
    flat: tuple[Tensor, ...]  # every parameter, in group order
    names: tuple[str, ...]  # their names, for errors
    scope_of: Tensor  # per parameter: the index of its scope, -1 for none
    sizes: tuple[int, ...]  # per group: its parameter count
    specs: tuple[tuple[Any, Any], ...]  # per parameter: its spec and local shape (preflight.presence)
    scoped: tuple[tuple[int, ...], ...]  # per scope: its parameters' indices
    step: StepScope  # this rank's part of the step group's row


class _Summed(NamedTuple):
    """One scope's row of the all-reduce, summed over its ranks, read by name."""

    ranks: int  # each rank adds 1
    digest: list[int]  # the agreement's digest pieces
    digest_squares: list[int]
    failed: int  # ranks whose local checks failed, here or in an earlier scope
    held: list[int]  # the gradient-presence digest pieces
    held_squares: list[int]
    bad: int  # sparse or mislaid gradients

    @classmethod
    def of(cls, row: Sequence[int]) -> _Summed:
        return cls(row[0], list(row[1:4]), list(row[4:7]), row[7], list(row[8:11]), list(row[11:14]), row[14])

    def disagree(self) -> bool:
        """The ranks built the optimizer unlike each other (their settings' digests differ)."""
        return disagree(self.ranks, self.digest, self.digest_squares)

    def held_unlike(self) -> bool:
        """Some rank holds a gradient unlike another's, or a bad one: the per-parameter flags must travel."""
        return bool(self.bad) or disagree(self.ranks, self.held, self.held_squares)


class StepChecks:
    """The agreement, the local checks and the preflight of ``Muon.step``, cached between steps."""

    def __init__(self, step_group: Any = None) -> None:
        self._step_group = step_group  # None: the default group, joined only by ranks with a scope
        self._key: tuple | None = None
        self._param_set: _ParamSetCache | None = None
        self.generation = 0  # counts parameter sets: the plan and state caches compare it, nothing else
        self._checked: tuple[int, set[tuple[Any, ...]]] = (0, set())  # settings whose parameter checks passed
        self.settings = SettingsCache()  # each group's checked settings, resolved again when they change
        self.resolved: list[Resolved] = []  # this step's, per group (the optimizer keeps its hypers on them)

    def param_set(self, groups: Sequence[Mapping[str, Any]], ddp_group: Any = None) -> int:
        """The generation of the current parameter set (local: no collective)."""
        self._param_set_of(groups, ddp_group)
        return self.generation

    def run(
        self, groups: Sequence[MutableMapping[str, Any]], ddp_group: Any = None
    ) -> tuple[list[NSConfig | None], list[list[int]]]:
        """Per group its Newton-Schulz config (None for AdamW) and the indices of the parameters
        with a gradient to apply; raises the same error on every rank of a scope."""
        param_set = self._param_set_of(groups, ddp_group)
        if self._checked[0] != self.generation:
            self._checked = (self.generation, set())
        self.resolved, error = _local_checks(groups, self._checked[1], self.settings)
        configs = [r.config for r in self.resolved]
        if error is None and param_set.step.outside is not None:
            error = ValueError(param_set.step.outside)
        bits, bad = presence(param_set.flat, param_set.specs)
        agreed_settings = [r.settings for r in self.resolved]
        agreed_settings += [settings_of(g) for g in groups[len(agreed_settings) :]]  # a group that failed
        digests = [
            digest_pieces(text + repr([agreed_settings[i] for i in members]))
            for text, members in zip(param_set.params, param_set.members)
        ]
        held = [_bits_pieces(bits, scoped) for scoped in param_set.scoped]
        heads, ranks, failed = _reduce(param_set, self._step_group, digests, held, bad, error)
        for k, head in enumerate(heads):
            if head.disagree():  # the root cause: a failed check may follow from it
                _explain(groups, ddp_group, param_set.scopes[k])
        if error is not None or failed:
            _raise_together(error, failed)
        slow = [k for k, head in enumerate(heads) if head.held_unlike()]
        present = list(bits) if not (slow or bad) else _present_slow(param_set, slow, ranks)
        it = iter(present)
        return configs, [[i for i in range(size) if next(it)] for size in param_set.sizes]

    def _param_set_of(self, groups: Sequence[Mapping[str, Any]], ddp_group: Any) -> _ParamSetCache:
        key = (
            id(ddp_group),
            tuple(
                (tuple(map(id, g["params"])), tuple(g.get("param_names", ())), g["algorithm"]) for g in groups
            ),
        )
        if key != self._key or self._param_set is None:
            self._param_set = _build_param_set(groups, ddp_group, self._step_group)
            self._key = key
            self.generation += 1
        return self._param_set


def _build_param_set(groups: Sequence[Mapping[str, Any]], ddp_group: Any, step_group: Any) -> _ParamSetCache:
    per_scope = dict(sorted(scope_entries(groups, ddp_group).items(), key=lambda kv: scope_key(kv[0])))
    everything = repr(all_params(groups))
    params = tuple(
        hashlib.blake2b((repr([(i, named) for i, _, named in e]) + everything).encode()).hexdigest()
        for e in per_scope.values()
    )
    members = tuple(tuple(i for i, _, _ in e) for e in per_scope.values())
    where = {scope: k for k, scope in enumerate(per_scope)}
    scope_of = [
        where.get(
            p.device_mesh if isinstance(p, DTensor) else (ddp_group if g["algorithm"] == "muon" else None), -1
        )
        for g in groups
        for p in g["params"]
    ]
    return _ParamSetCache(
        tuple(per_scope),
        params,
        members,
        tuple(p for g in groups for p in g["params"]),
        tuple(n for i, g in enumerate(groups) for n in param_names(g, i)),
        torch.tensor(scope_of, dtype=torch.int64),
        tuple(len(g["params"]) for g in groups),
        specs_of([p for g in groups for p in g["params"]]),
        tuple(tuple(i for i, s in enumerate(scope_of) if s == k) for k in range(len(per_scope))),
        step_scope(list(per_scope), step_group, explicit=step_group is not None),
    )


def _explain(groups: Sequence[Mapping[str, Any]], ddp_group: Any, scope: Any) -> None:
    """Every rank of ``scope`` saw the digests differ: gather what they are of and name the field."""
    mine = [*scope_entries(groups, ddp_group)[scope], all_params(groups)]
    explain(scope, mine, gather_over_scope(mine, scope))


def _local_checks(
    groups: Sequence[MutableMapping[str, Any]], checked: set[tuple[Any, ...]], settings: SettingsCache
) -> tuple[list[Resolved], Exception | None]:
    """Every group's settings, resolved (``validation.check_group``, normalizing its keys) where
    they changed (``settings``), and ``check_switched`` of its parameters where the settings it
    reads are new (``checked``: those already passed for this parameter set); the groups resolved
    up to the first error caught (raised once every rank knows)."""
    resolved: list[Resolved] = []
    for index, group in enumerate(groups):
        try:
            entry = settings.resolve(index, group)
            lr = group["lr"]
            where = (lr.device, lr.dtype) if isinstance(lr, Tensor) else None
            key = (index, group["algorithm"], group.get("momentum_dtype"), group.get("capturable"), where)
            if key not in checked:
                check_switched(group, param_names(group, index))
                checked.add(key)
            resolved.append(entry)
        except Exception as e:  # noqa: BLE001 - any local failure is raised on every rank
            return resolved, e
    return resolved, None


def _reduce(
    param_set: _ParamSetCache,
    step_group: Any,
    digests: Sequence[Sequence[int]],
    held: Sequence[Sequence[int]],
    bad: int,
    error: Exception | None,
) -> tuple[list[_Summed], list[int], int]:
    """Per scope, in order, its row (``_Summed``'s fields, one integer each or three digest pieces)
    summed over the scope, and its rank count; and how many ranks failed a local check. First the
    step group's row (``step_scope``): the fingerprint of every rank's scopes, the failures and the
    row of the scope spanning the group. A lacking mesh is raised there, on every rank of the group,
    so every rank then reduces over the same scopes, in the same order."""
    rows = [_row(int(error is not None), p, b, bad) for p, b in zip(digests, held)]
    heads: dict[int, _Summed] = {}
    ranks: dict[int, int] = {}
    failed = int(error is not None)
    step = param_set.step
    if step.joins:
        fold = step.folded
        own = rows[fold] if fold is not None else [0] * _ROW
        ((sums, size),) = summed([failed, *step.pieces, *own], [group_of(step_group)])
        if not agreed(sums[1:3]):
            _lacking(param_set, step_group)
        failed = sums[0]
        if fold is not None:
            heads[fold], ranks[fold] = _Summed.of(sums[3:]), size
    for k, scope in enumerate(param_set.scopes):
        if k not in heads:
            ((sums, size),) = summed(rows[k], [scope])
            heads[k], ranks[k] = _Summed.of(sums), size
            failed = max(failed, heads[k].failed)
    return [heads[k] for k in range(len(rows))], [ranks[k] for k in range(len(rows))], failed


_ROW = 15  # _Summed's fields


def _row(failed: int, pieces: Sequence[int], bits: Sequence[int], bad: int) -> list[int]:
    return [1, *pieces, *(x * x for x in pieces), failed, *bits, *(x * x for x in bits), bad]


def _lacking(param_set: _ParamSetCache, step_group: Any) -> None:
    """Some rank of the step group lacks a mesh its peers step on: name it, on every rank."""
    everyone = gather_over_scope([scope_key(s) for s in param_set.scopes], group_of(step_group))
    raise ValueError(
        f"ranks disagree about the meshes they step on: {describe(everyone)}. Every rank of a mesh must "
        "hold parameters on it in its optimizer (build the model and optimizer the same way on every "
        "rank); under pipeline parallelism, pass each stage's group as Muon(step_group=...)"
    )


def _bits_pieces(bits: bytes, scoped: Sequence[int]) -> list[int]:
    """The presence bits of a scope's parameters as a 63-bit digest in three pieces: equal on
    every rank of the scope iff (but for a 2^-63 collision) every rank has the same gradients."""
    return digest_pieces(bytes(bits[i] for i in scoped).hex())


def _present_slow(param_set: _ParamSetCache, slow: Sequence[int], ranks: Sequence[int]) -> list[bool]:
    """Some scope's ranks hold gradients unlike each other, or a bad one: the full flags summed
    over those scopes (every rank of such a scope saw the same sums, so all of them reduce) to
    name the parameter. A scope whose ranks agree sums to its rank count times the local flags."""
    flags = local_flags(param_set.flat)
    sums = []
    for k, scope in enumerate(param_set.scopes):
        if k in slow:
            sums.append(sum_over_scopes(flags.flatten(), [scope])[0][0].view(flags.shape))
        else:
            sums.append(flags * torch.tensor([ranks[k], 1, 1], dtype=torch.int64))
    return _present(param_set, flags, sums, ranks)


def _raise_together(error: Exception | None, failed: int) -> None:
    """A local check failed on some rank: it raises its own error, the others say where to look."""
    if error is not None:
        raise error
    ranks = max(failed, 1)
    raise ValueError(
        f"the optimizer's settings failed a check on {ranks} other rank(s) of a mesh this rank shares "
        "(their error names the group and the value); fix the value there, or set it on every rank"
    )


def _present(
    param_set: _ParamSetCache, mine: Tensor, sums: Sequence[Tensor], ranks: Sequence[int]
) -> list[bool]:
    """Which parameters have a gradient somewhere in their scope; raises (``preflight.raise_for``)
    for a sparse or mislaid gradient, or one present on some ranks of a scope only. A parameter no
    collective involves still must not fail on one rank alone: its sparse and mislaid counts are
    the largest over every scope of this rank. A few tensor ops, whatever the parameter count."""
    n = mine.shape[0]
    unscoped = param_set.scope_of < 0
    rows, counts = mine.clone(), torch.full((n,), max(ranks, default=1), dtype=torch.int64)
    if sums:
        stacked = torch.stack(list(sums))  # [scopes, n, 3]
        index = param_set.scope_of.clamp(min=0)
        rows = torch.where(unscoped[:, None], rows, stacked[index, torch.arange(n)])
        worst = torch.maximum(mine[:, 1:], stacked[:, :, 1:].amax(dim=0))
        rows[:, 1:] = torch.where(unscoped[:, None], worst, rows[:, 1:])
        counts = torch.where(unscoped, counts, torch.tensor(ranks, dtype=torch.int64)[index])
    partial = ~unscoped & (rows[:, 0] > 0) & (rows[:, 0] < counts)
    bad = (rows[:, 1] > 0) | (rows[:, 2] > 0) | partial
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        p = param_set.flat[i]
        scope = True if int(param_set.scope_of[i]) >= 0 else None
        raise_for(PreflightItem(param_set.names[i], p, p.grad, scope), rows[i].tolist(), int(counts[i]))
    return (rows[:, 0] > 0).tolist()
