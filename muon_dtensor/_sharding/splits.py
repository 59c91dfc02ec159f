"""Which matrices a Muon group splits over several ranks (``ns_split``), and over how many.

``"off"`` (default): none, so every step equals the one-process step bitwise. An integer k: every
matrix of the group whose long side has at least k elements, over min(k, the exchange group's
ranks) ranks (a group of one splits nothing). ``"auto"``: the cost model's choice
(``planning/split.plan_splits``: a k per shape, taken only where it shortens the busiest rank's
modelled time), priced on H200 figures with this job's node size. The choice depends only on global shapes, the group's size and the node size, so
every rank of a group makes the same one (the agreement checks ``ns_split`` itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..planning.hardware import Hardware
from ..planning.split import plan_splits

__all__ = ["SplitPolicy"]


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
