"""Each param group's settings, resolved when they change rather than every step.

A group's checks (``validation.check_group``: its one normalization, its value checks and its
Newton-Schulz config) and its agreed settings (``agreement.settings_of``, what the digest compares)
are pure functions of the values ``RESOLVED_KEYS`` names. So each group keeps what they returned
with a key of those values, and a steady step only builds the key and compares it: a value set
later (or set back, or a tensor lr filled in place) changes the key, and the group is resolved
again exactly as the constructor resolved it. Only a group that passed its checks is kept, so a
bad value fails at every step until it is fixed.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..numerics.newton_schulz import NSConfig
from .agreement import AGREED_KEYS, settings_of
from .validation import check_group

__all__ = ["RESOLVED_KEYS", "Resolved", "SettingsCache", "settings_key"]

# What the checks, the normalization and the digest read from a group: the agreed keys
# (tests/checks/test_settings_cache.py holds the checks to this list).
RESOLVED_KEYS: tuple[str, ...] = AGREED_KEYS
_ABSENT = object()  # a key the group lacks (a group saved before the key existed)


@dataclass(frozen=True)
class Resolved:
    """A group's resolved settings and the key of the values they came from."""

    key: tuple[Any, ...]
    config: NSConfig | None  # the Newton-Schulz config; None for an AdamW group
    settings: tuple[tuple[str, Any], ...]  # ``settings_of(group)``: the digest's plain data


def _frozen(value: Any) -> Any:
    """``value`` as comparable data with its type, so that ``True``, ``1`` and ``1.0`` (equal in
    Python) and a list changed in place are told apart; a tensor by its identity and kind."""
    kind = type(value)
    if kind is list or kind is tuple:
        return (kind, tuple(_frozen(v) for v in value))
    if isinstance(value, Tensor):
        return (Tensor, id(value), value.dtype, value.device, tuple(value.shape))
    return (kind, value)


def settings_key(group: MutableMapping[str, Any]) -> tuple[Any, ...]:
    """The values a group's resolution reads. A tensor lr is keyed by its identity and kind, and
    by its value unless the group is capturable (then the value stays on the device, where a
    schedule fills it in place, and nothing here reads it: the step reads it there)."""
    key = tuple(_frozen(group.get(k, _ABSENT)) for k in RESOLVED_KEYS)
    lr = group.get("lr")
    if isinstance(lr, Tensor) and group.get("capturable") is not True and lr.numel() == 1:
        return (*key, float(lr))  # the value the step reads (torch.optim reads it likewise)
    return key


class SettingsCache:
    """The resolved settings of an optimizer's param groups, by group index."""

    def __init__(self) -> None:
        self._entries: dict[int, Resolved] = {}

    def resolve(self, index: int, group: MutableMapping[str, Any]) -> Resolved:
        """Group ``index``'s settings: kept ones if its key is unchanged, else checked and
        normalized now (``check_group``; raises as it does, and then keeps nothing)."""
        key = settings_key(group)
        entry = self._entries.get(index)
        if entry is not None and entry.key == key:
            return entry
        self._entries.pop(index, None)
        config = check_group(group, index)  # may normalize values: the key is taken again after it
        entry = Resolved(settings_key(group), config, settings_of(group))
        self._entries[index] = entry
        return entry

    def clear(self) -> None:
        self._entries.clear()
