"""The settings cache's key (``checks/settings_cache.py``): it must hold every value the checks,
the normalization and the digest read, or a value changed later would step with stale settings;
and it must tell apart values Python calls equal (``True == 1 == 1.0``) but the checks do not."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from muon_dtensor.checks.agreement import settings_of
from muon_dtensor.checks.settings_cache import RESOLVED_KEYS, SettingsCache, settings_key
from muon_dtensor.checks.validation import check_group


class _Reads(dict[str, Any]):
    """A param group that records which keys are read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


MUON: dict[str, Any] = {
    "algorithm": "muon", "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315), "eps": 1e-7, "ns_steps": 5, "adjust_lr_fn": None,
    "ns_dtype": torch.float32, "momentum_dtype": torch.int8, "ns_algorithm": "standard", "mode": "owner",
    "max_round_bytes": 1 << 20, "flatten": False, "experts": False, "split_sizes": None, "head_dim": None,
    "owners": "auto", "normuon": False, "beta2": 0.95, "ns_split": 2, "capturable": False,
    "params": [], "param_names": [], "initial_lr": 0.02, "foreach": None,
}  # fmt: skip
ADAMW: dict[str, Any] = {
    "algorithm": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
    "capturable": False, "normuon": False, "momentum_dtype": None, "params": [],
}  # fmt: skip


@pytest.mark.parametrize("group", [MUON, ADAMW], ids=["muon", "adamw"])
def test_the_key_holds_every_value_the_checks_and_the_digest_read(group: dict[str, Any]) -> None:
    reads = _Reads(group)
    check_group(reads, 0)
    settings_of(reads)
    assert reads.read - {"params", "param_names"} <= set(RESOLVED_KEYS)


@pytest.mark.parametrize(
    ("key", "a", "b"),
    [("nesterov", True, 1), ("ns_steps", 5, 5.0), ("lr", 1, 1.0), ("weight_decay", 0.0, False)],
)
def test_values_python_calls_equal_make_different_keys(key: str, a: Any, b: Any) -> None:
    assert a == b and settings_key({**MUON, key: a}) != settings_key({**MUON, key: b})


def test_a_list_changed_in_place_and_a_tensor_lr_filled_in_place_make_new_keys() -> None:
    group = {**MUON, "ns_coefficients": [[3.4, -4.7, 2.0], [3.0, -3.2, 1.2]]}
    before = settings_key(group)
    group["ns_coefficients"][1][0] = 2.0
    assert settings_key(group) != before
    lr = torch.tensor(0.02)
    group = {**MUON, "lr": lr}
    before = settings_key(group)
    lr.fill_(0.03)
    assert settings_key(group) != before


def test_a_capturable_groups_tensor_lr_is_keyed_by_its_kind_not_read() -> None:
    """Its value stays on the device (a schedule fills it in place; reading it would sync): the
    step reads it there every step, and neither the checks nor the digest read it."""
    lr = torch.tensor(0.02, dtype=torch.float64)
    group = {**MUON, "lr": lr, "capturable": True}
    before = settings_key(group)
    lr.fill_(0.03)
    assert settings_key(group) == before
    assert settings_key({**group, "lr": lr.float()}) != before  # another tensor: another key


def test_a_group_is_resolved_again_only_when_its_key_changes() -> None:
    cache, group = SettingsCache(), dict(MUON)
    first = cache.resolve(0, group)
    assert group["momentum_dtype"] == "int8" and group["ns_dtype"] == "float32"  # normalized once
    assert cache.resolve(0, group) is first
    group["momentum_dtype"] = torch.int8  # the same value as a dtype: normalized again, same settings
    again = cache.resolve(0, group)
    assert again is not first and again.settings == first.settings and group["momentum_dtype"] == "int8"
    group["lr"] = -1.0
    with pytest.raises(ValueError, match="Learning rate should be >= 0"):
        cache.resolve(0, group)
    with pytest.raises(ValueError, match="Learning rate should be >= 0"):  # nothing kept: refused again
        cache.resolve(0, group)
