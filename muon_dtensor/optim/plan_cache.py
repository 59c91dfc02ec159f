"""Each Muon group's plan, kept between steps: its sharding (layouts, views, owner meshes, exchange
groups), its split policy and its domains per set of parameters with a gradient. It is built
(collectively) on first use and again only when the parameter set changes (the checks' generation,
``StepChecks.generation``) or a setting the plan reads changes, so a steady step finds it with one
tuple comparison per group and builds no key over the parameters."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..sharding.plan.domains import Domain, ViewOptions
from .group_sharding import GroupSharding
from .policy import SplitPolicy, split_policy

__all__ = ["PLAN_KEYS", "PlanCache", "PlanEntry"]

# The group keys a plan reads: how parameters split into matrices (ViewOptions), where owners are,
# how rounds are cut, and which matrices split (SplitPolicy.of).
PLAN_KEYS = (
    "flatten", "experts", "split_sizes", "head_dim", "normuon", "ns_dtype", "ns_algorithm", "ns_steps",
    "owners", "mode", "max_round_bytes", "ns_split",
)  # fmt: skip
# Builds a group's sharding from its view options and owners (collective: it may create groups).
Build = Callable[[ViewOptions, str], GroupSharding]


@dataclass
class PlanEntry:
    """One group's plan: what it was built for, and what was built."""

    key: tuple[Any, ...]  # (parameter-set generation, the PLAN_KEYS values)
    sharding: GroupSharding
    policy: SplitPolicy
    domains: dict[tuple[int, ...], list[Domain]] = field(default_factory=dict)


class PlanCache:
    """The plans of an optimizer's Muon groups, by group index."""

    def __init__(self) -> None:
        self.entries: dict[int, PlanEntry] = {}

    def sharding(
        self, index: int, group: Mapping[str, Any], generation: int, build: Build, keep: bool = True
    ) -> GroupSharding:
        """Group ``index``'s sharding, rebuilt only when its parameters or plan settings changed;
        ``keep=False``: a new one is built for the caller alone (a report's, built locally)."""
        key = (generation, tuple(_frozen(group.get(k)) for k in PLAN_KEYS))
        entry = self.entries.get(index)
        if entry is None or entry.key != key:
            owners = group.get("owners", "auto")  # a group loaded from an older state dict may lack it
            entry = PlanEntry(key, build(ViewOptions.of(group), owners), split_policy(group))
            if keep:
                self.entries[index] = entry
        return entry.sharding

    def domains(self, index: int, group: Mapping[str, Any], todo: Sequence[int]) -> list[Domain]:
        """The domains of group ``index``'s parameters at ``todo`` (after ``sharding`` this step)."""
        entry = self.entries[index]
        key = tuple(todo)
        if key not in entry.domains:
            entry.domains[key] = entry.sharding.domains(
                todo, group["mode"], group["max_round_bytes"], entry.policy
            )
        return entry.domains[key]

    def built(self, index: int) -> GroupSharding | None:
        """Group ``index``'s sharding if a step or a report built it, else None (no collective)."""
        entry = self.entries.get(index)
        return entry.sharding if entry is not None else None


def _frozen(value: Any) -> Any:
    """A list setting as a tuple: a list changed in place must not compare equal to itself."""
    return tuple(value) if isinstance(value, list) else value
