"""Where a checkpoint keeps each entry (its DCP keys), and the state dicts a save writes and a load
fills, for one model part or several per rank (pipeline stages, torchtitan's ``model_parts``).

- Format 2 (``PER_FQN``, written since 0.3.0) is torchtitan's own: the model's FQNs at the top level,
  the optimizer under ``optimizer.`` keyed per parameter (``optimizer.state.<fqn>.<key>``,
  ``optimizer.param_groups.<fqn>.<setting>``), as ``StateDictOptions(flatten_optimizer_state_dict=True)``
  writes it. Stages' entries never collide, any grouping of the same parameters loads them, and
  torchtitan's ``CheckpointManager`` reads the folder (and we read its).
- Format 1 (``BY_INDEX``, before 0.3.0): ``model.<fqn>`` and ``optim.state.<fqn>.<key>`` with param
  groups by index (``optim.param_groups.<i>.<setting>``): one model and one optimizer per rank.

Param-group ``param_names`` are not saved: torch would write each group's whole list once per
parameter, and a load keeps this optimizer's names anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

__all__ = [
    "BY_INDEX",
    "PER_FQN",
    "TORCHTITAN",
    "KeyFormat",
    "Layout",
    "Models",
    "Optimizers",
    "Parts",
    "format_of_manifest",
    "layout_of_manifest",
    "optimizer_types",
]

_NAMES = "param_names"
Models = nn.Module | Sequence[nn.Module]  # one model part, or a rank's parts
Optimizers = Optimizer | Sequence[Optimizer] | None  # one per part; None: weights only


@dataclass(frozen=True)
class KeyFormat:
    """The key prefixes of one checkpoint format (where a checkpoint keeps each entry)."""

    format: int
    model: str  # prefix of the model's entries
    optim: str  # prefix of the optimizer's entries
    others: tuple[str, ...] = ("extra.",)  # prefixes of entries that are neither (extra tensors, ...)

    def part(self, key: str) -> str:
        """``"optim"``, ``"model"`` or ``"other"``: which part of a load ``key`` belongs to."""
        if key.startswith(self.optim):
            return "optim"
        if key.startswith(self.others) or not key.startswith(self.model):
            return "other"
        return "model"


PER_FQN = KeyFormat(2, "", "optimizer.")
BY_INDEX = KeyFormat(1, "model.", "optim.")
# A folder torchtitan's CheckpointManager wrote: format 2, plus its trainer's own entries.
TORCHTITAN = KeyFormat(2, "", "optimizer.", ("extra.", "train_state.", "lr_scheduler.", "dataloader."))


def format_of_manifest(manifest: dict[str, Any]) -> KeyFormat:
    return PER_FQN if manifest.get("format", 1) == 2 else BY_INDEX


# The names before 0.6 (``checkpoint.layout.Layout``), for one release: "layout" is a parameter's
# placement on the mesh (docs/design.md, "Four layouts").
Layout = KeyFormat
layout_of_manifest = format_of_manifest


def optimizer_types(optimizer: Optimizers) -> str | None:
    """What the ranks must agree on about the optimizers: whether any was given (None: weights
    only) and the set of their type names, sorted and joined. Not the list itself: ranks may hold different
    parts (``[opt]`` here, ``opt`` there; two virtual stages here, one there)."""
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    names = sorted({type(o).__qualname__ for o in given if o is not None})
    return ", ".join(names) if names else None


@dataclass(frozen=True)
class Parts:
    """A rank's model parts and their optimizers (None: weights only), paired in order."""

    models: tuple[nn.Module, ...]
    optimizers: tuple[Optimizer | None, ...]

    @staticmethod
    def of(model: Models, optimizer: Optimizers) -> Parts:
        """From a save or load's arguments; ValueError (local, before any collective) for lists
        that do not pair up."""
        models = (model,) if isinstance(model, nn.Module) else tuple(model)
        optims = optimizer if isinstance(optimizer, (list, tuple)) else None
        if optims is None:
            optims = (optimizer,) * len(models) if optimizer is None else (optimizer,)
        if not models or not all(isinstance(m, nn.Module) for m in models):
            raise TypeError(f"model should be an nn.Module or a list of them (model parts) but is {model!r}")
        if len(optims) != len(models):
            raise ValueError(
                f"{len(models)} model part(s) but {len(optims)} optimizer(s): pass one optimizer per model "
                "part, in the same order (torchtitan: model_parts and optimizers.optimizers)"
            )
        return Parts(models, tuple(optims))

    @property
    def has_optimizer(self) -> bool:
        return any(o is not None for o in self.optimizers)

    def pairs(self) -> list[tuple[nn.Module, Optimizer | None]]:
        return list(zip(self.models, self.optimizers))


def flatten_optim(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], list[list[str]]]:
    """An FQN-keyed optimizer state dict (``get_state_dict``'s) per parameter: ``state.<fqn>.<key>``
    and ``param_groups.<fqn>.<setting>`` (torch's and torchtitan's keys), and each group's FQNs."""
    flat: dict[str, Any] = {}
    for fqn, entries in optim_sd["state"].items():
        _flatten_nested(entries, f"state.{fqn}", flat)
    groups = []
    for group in optim_sd["param_groups"]:
        groups.append(list(group["params"]))
        settings = {k: v for k, v in group.items() if k not in ("params", _NAMES)}
        for fqn in group["params"]:
            flat.update({f"param_groups.{fqn}.{k}": v for k, v in settings.items()})
    return flat, groups


def _flatten_nested(entries: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in entries.items():
        if isinstance(value, dict):
            _flatten_nested(value, f"{prefix}.{key}", out)
        else:
            out[f"{prefix}.{key}"] = value


def unflatten_optim(flat: dict[str, Any], current: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """The FQN-keyed optimizer state dict for ``set_state_dict``: each current group's settings from
    its first parameter's loaded entries (the load checked they agree), the others as they are."""
    state: dict[str, Any] = {}
    for fqn, entries in current["state"].items():
        state[fqn] = _nested(entries, f"state.{fqn}", flat)
    param_groups = []
    for group, fqns in zip(current["param_groups"], groups):
        first = fqns[0] if fqns else None
        param_groups.append(
            {k: flat.get(f"param_groups.{first}.{k}", v) if k != "params" else v for k, v in group.items()}
        )
    return {"state": state, "param_groups": param_groups}


def _nested(entries: dict[str, Any], prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _nested(v, f"{prefix}.{k}", flat) if isinstance(v, dict) else flat.get(f"{prefix}.{k}", v)
        for k, v in entries.items()
    }


@dataclass
class PartState:
    """One model part's entries in a save or load: model FQN -> tensor, the optimizer's flat entries
    (empty without one), its FQN-keyed state dict as ``get_state_dict`` gave it and its groups' FQNs."""

    model: dict[str, Any]
    optim: dict[str, Any]
    current: dict[str, Any] | None
    groups: list[list[str]]


def part_states(parts: Parts, with_optimizer: bool) -> list[PartState]:
    out = []
    for model, optimizer in parts.pairs():
        if optimizer is None or not with_optimizer:
            out.append(PartState(get_state_dict(model, [])[0], {}, None, []))
            continue
        model_sd, optim_sd = get_state_dict(model, optimizer)
        flat, groups = flatten_optim(optim_sd)
        out.append(PartState(model_sd, flat, optim_sd, groups))
    return out


def dcp_state(states: list[PartState]) -> dict[str, Any]:
    """The format-2 state dict of a rank's parts (to save, or for a load to fill); ValueError naming
    the FQN when two parts hold the same entry or a model FQN would read as another part's."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for s in states:
        for target, entries in ((model, s.model), (optim, s.optim)):
            twice = target.keys() & entries.keys()
            if twice:
                raise ValueError(
                    f"the model parts hold the same entries: {sorted(twice)[:4]}; each parameter must be in "
                    "one model part (a parameter shared between stages cannot be saved per FQN)"
                )
            target.update(entries)
    clash = [k for k in model if PER_FQN.part(k) != "model"]
    if clash:
        raise ValueError(
            f"model FQN {clash[0]!r} starts with {PER_FQN.optim!r} or 'extra.', which the checkpoint keeps "
            "for the optimizer and extra state; rename that module"
        )
    return {**model, "optimizer": optim} if optim else model


def apply(state: dict[str, Any], states: list[PartState], parts: Parts) -> None:
    """Hand a loaded format-2 ``state`` to each part and its optimizer."""
    optim = state.get("optimizer", {})
    for s, (model, optimizer) in zip(states, parts.pairs()):
        model_sd = {k: state[k] for k in s.model}
        if s.current is None or optimizer is None:
            set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
            continue
        osd = unflatten_optim(optim, s.current, s.groups)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=osd)
