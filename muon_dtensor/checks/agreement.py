"""The agreement: before any other collective of a step, the ranks of every mesh (and of the DDP
group) check that they built the optimizer alike, so a difference is an error on every rank that
names the field, never a silent divergence (docs/unsupported.md lists what is compared). This module
makes the digests and explains a difference; ``step_checks.py`` sums them with the preflight's flags.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from ..base.names import param_names
from .preflight import layout_text

__all__ = [
    "AGREED_KEYS",
    "Entry",
    "all_params",
    "explain",
    "plain",
    "scope_entries",
    "settings_of",
]

# What every rank of a mesh (or DDP group) must share for the sharded step to be the one-process
# step: the settings that decide the plan or the maths, and each parameter's name, shape and layout
# in order. AdamW groups of plain tensors are stepped locally, so they may differ.
AGREED_KEYS = (
    "algorithm", "lr", "weight_decay", "momentum", "betas", "nesterov", "ns_coefficients", "eps",
    "ns_steps", "adjust_lr_fn", "ns_dtype", "momentum_dtype", "ns_algorithm", "mode", "max_round_bytes",
    "flatten", "experts", "split_sizes", "head_dim", "owners", "normuon", "beta2", "ns_split",
    "capturable",
)  # fmt: skip
Entry = tuple[int, tuple[tuple[str, Any], ...], tuple[tuple[str, str], ...]]


def plain(value: Any) -> Any:
    """A setting as comparable plain data (a tensor lr as its float, sequences as tuples); never
    raises, so a bad value is compared before any check of it runs."""
    if isinstance(value, Tensor):
        return float(value) if value.numel() == 1 else repr(value)
    if isinstance(value, (list, tuple)):
        return tuple(plain(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def scope_entries(groups: Sequence[Mapping[str, Any]], ddp_group: Any = None) -> dict[Any, list[Entry]]:
    """Per scope (mesh or DDP group), in order of first appearance: for every group with parameters
    there, (group index, settings, (name, shape and placements) of those parameters in order)."""
    out: dict[Any, list[Entry]] = {}
    for index, group in enumerate(groups):
        ddp = ddp_group if group["algorithm"] == "muon" else None
        settings = settings_of(group)
        params: dict[Any, list[tuple[str, str]]] = {}
        for p, name in zip(group["params"], param_names(group, index)):
            scope = p.device_mesh if isinstance(p, DTensor) else ddp
            if scope is not None:
                params.setdefault(scope, []).append((name, layout_text(p)))
        for scope, named in params.items():
            out.setdefault(scope, []).append((index, settings, tuple(named)))
    return out


def all_params(groups: Sequence[Mapping[str, Any]]) -> Entry:
    """Every parameter in order: the preflight's table rows, which must line up on every rank."""
    named = [
        (n, layout_text(p)) for i, g in enumerate(groups) for p, n in zip(g["params"], param_names(g, i))
    ]
    return (-1, (), tuple(named))


def settings_of(group: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The agreed settings of a group, as plain data; a capturable group's tensor lr by its kind
    only (its value stays on the device, where a schedule changes it in place)."""
    device_lr = group.get("capturable", False) is True and isinstance(group.get("lr"), Tensor)
    return tuple(
        (k, _kind(group[k]) if device_lr and k == "lr" else plain(group[k]))
        for k in AGREED_KEYS
        if k in group
    )


def _kind(t: Tensor) -> str:
    return f"tensor({t.dtype}, {t.device.type})"


def explain(scope: Any, mine: list[Entry], everyone: dict[int, list[Entry]]) -> None:
    kinds: dict[str, list[int]] = {}
    for rank, theirs in sorted(everyone.items()):
        kinds.setdefault(repr(theirs), []).append(rank)
    first = min(everyone.items())[1]
    other = next((e for e in everyone.values() if e != first), mine)
    if len(kinds) == 1:  # a gather that hands back this rank's entries as every rank's (a fake group)
        raise ValueError(
            f"ranks disagree about the optimizer on {scope}, but the entries gathered from ranks "
            f"{sorted(everyone)} are all this rank's: that group's gather moves nothing (torch's fake "
            "backend), so the difference cannot be named. Give its ranks a real backend to compare them"
        )
    raise ValueError(
        f"ranks disagree about the optimizer on {scope}: {_difference(first, other)} (ranks that agree: "
        f"{' | '.join(str(r) for r in kinds.values())}). Build the optimizer the same way on every rank: "
        "the same parameters in the same order (pass named parameters to have names checked), groups "
        "and settings"
    )


def _difference(a: list[Entry], b: list[Entry]) -> str:
    """The first field in which two ranks' entries differ, with both values."""
    if [e[0] for e in a] != [e[0] for e in b]:
        return f"param groups holding parameters here: {[e[0] for e in a[:-1]]} vs {[e[0] for e in b[:-1]]}"
    for (index, sa, pa), (_, sb, pb) in zip(a, b):
        for (key, va), (_, vb) in zip(sa, sb):
            if va != vb:
                return f"param group {index} '{key}': {va!r} vs {vb!r}"
        if pa != pb:
            diff = next(((x, y) for x, y in zip(pa, pb) if x != y), (pa[len(pb) :], pb[len(pa) :]))
            where = "the optimizer's parameters" if index < 0 else f"param group {index} parameters"
            return f"{where} (name, layout): {diff[0]} vs {diff[1]}"
    return "their settings"
