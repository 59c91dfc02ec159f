"""The optimizer state's plumbing, outside the ``Muon`` shell: eager state, state that follows a
parameter swapped for its DTensor, momentum buffers kept in the group's ``momentum_dtype``, and
counters brought back to the host after a load."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from ..base.names import param_names
from ..base.warn import warn
from ..numerics.blockwise import absmax_shape, dequantize, quantize
from ..sharding.plan.param_layout import block_state_zeros, local_of, relayout, row_state_zeros

__all__ = [
    "MOMENTUM",
    "MOMENTUM_ABSMAX",
    "SECOND_MOMENT",
    "Conversion",
    "follow_replaced",
    "init_params",
    "init_state",
    "load_keeping",
    "row_states",
    "own_keys",
    "momentum_dtype",
    "put_momentum",
    "restore_keys",
    "settle_loaded",
    "take_momentum",
    "warn_converted",
]

MOMENTUM = "momentum_buffer"  # torch.optim.Muon's state key
SECOND_MOMENT = "second_momentum_buffer"  # NorMuon's state key, the official implementation's name
MOMENTUM_ABSMAX = "momentum_absmax"  # int8 momentum's float32 block maxima (numerics/blockwise.py)
State = MutableMapping[Tensor, dict[str, Any]]
Conversion = tuple[int, int, torch.dtype, torch.dtype]  # group, position in it, saved and new dtype


def momentum_dtype(group: Mapping[str, Any], p: Tensor) -> torch.dtype:
    """The dtype of ``p``'s momentum buffer: the group's ``momentum_dtype`` (a name, or a dtype set
    on the group after construction), else ``p``'s."""
    value = group.get("momentum_dtype")
    if value is None or group["algorithm"] != "muon":
        return p.dtype
    return value if isinstance(value, torch.dtype) else getattr(torch, value)


def init_state(state: State, group: Mapping[str, Any], p: Tensor) -> torch.dtype | None:
    """Create ``p``'s missing state eagerly, so every rank has the same keys even before the first
    step and a checkpoint at step 0 (or of a parameter that never got a gradient) is complete. A
    momentum buffer in another dtype than the group's ``momentum_dtype`` (the key was changed, or
    a load brought another) is converted; returns its previous dtype then, else None."""
    muon = group["algorithm"] == "muon"
    mine = state[p]
    if not muon:  # AdamW's counter: on the host, or with capturable on the device (as torch's)
        where = local_of(p).device if group.get("capturable", False) else torch.device("cpu")
        step = mine.get("step", torch.tensor(0.0))
        if step.device != where or step.dtype != torch.float32:  # else the same tensor stays
            step = step.detach().to(where, torch.float32)
        mine["step"] = step
    for key in (MOMENTUM,) if muon else ("exp_avg", "exp_avg_sq"):
        if key not in mine:
            dtype = momentum_dtype(group, p) if muon else p.dtype
            mine[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    if muon and group.get("normuon", False) and SECOND_MOMENT not in mine:
        mine[SECOND_MOMENT] = row_state_zeros(p)  # one value per row, laid out with p
    if muon and mine[MOMENTUM].dtype == torch.int8 and MOMENTUM_ABSMAX not in mine:
        mine[MOMENTUM_ABSMAX] = block_state_zeros(p)  # a fresh int8 buffer: zeros, exact
    old = mine[MOMENTUM].dtype if muon else None
    if old is not None and old != momentum_dtype(group, p):
        convert_momentum(mine, p, momentum_dtype(group, p))  # one rounding, or exact widening
        return old
    return None


def convert_momentum(mine: dict[str, Any], p: Tensor, dtype: torch.dtype) -> None:
    """``p``'s momentum buffer in ``dtype``, in place in its state ``mine``: a float cast, or to and
    from 8-bit blocks (their maxima kept beside them) on the local shard, laid out as ``p``."""
    buf = mine[MOMENTUM]
    if buf.dtype != torch.int8 and dtype != torch.int8:
        mine[MOMENTUM] = buf.to(dtype)
        return
    new = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
    if dtype == torch.int8:
        absmax = block_state_zeros(p)
        q, scales = quantize(local_of(buf).to(torch.promote_types(buf.dtype, torch.float32)))
        local_of(new).copy_(q)
        local_of(absmax).copy_(scales)
        mine[MOMENTUM_ABSMAX] = absmax
    else:
        absmax = mine.pop(MOMENTUM_ABSMAX)
        local_of(new).copy_(
            dequantize(local_of(buf), local_of(absmax), torch.promote_types(dtype, torch.float32))
        )
    mine[MOMENTUM] = new


def init_params(
    state: State, group: Mapping[str, Any], index: int, positions: Sequence[int]
) -> list[Conversion]:
    """``init_state`` for the parameters at ``positions`` of group ``index``; the momentum buffers
    it converted."""
    converted = []
    for i in positions:
        p = group["params"][i]
        old = init_state(state, group, p)
        if old is not None:
            converted.append((index, i, old, state[p][MOMENTUM].dtype))
    return converted


def follow_replaced(state: State, groups: Sequence[Mapping[str, Any]], seen: dict[int, list[Tensor]]) -> None:
    """Parameters replaced in place in ``groups`` (accelerate and HF Trainer swap in the DTensors
    ``fully_shard`` made) take over their predecessors' state, laid out like them; ``seen`` holds
    each group's parameters as last seen and is brought up to date."""
    for index, group in enumerate(groups):
        for old, new in zip(seen.get(index, []), group["params"]):
            if old is not new and old in state and new not in state:
                state[new] = {k: relayout(v, old, new) for k, v in state.pop(old).items()}
        seen[index] = list(group["params"])


# A load keeps this optimizer's, not the saved ones: names, and how this job keeps its state
KEPT_KEYS = ("param_names", "momentum_dtype", "capturable")


def row_states(state: State, group: Mapping[str, Any]) -> list[Tensor | None]:
    """Each parameter's NorMuon second moment (None without), its state created first (a group that
    switched NorMuon on after construction has none yet)."""
    for p in group["params"]:
        init_state(state, group, p)
    return [state[p].get(SECOND_MOMENT) for p in group["params"]]


def load_keeping(
    opt: Any, load: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]
) -> list[Conversion]:
    """``Muon.load_state_dict``: torch's ``load`` of ``state_dict`` into ``opt`` keeping each
    group's ``KEPT_KEYS`` and the momentum buffers' dtypes out of torch's cast; then the state the
    checkpoint lacks, created. Returns the buffers converted to their group's ``momentum_dtype``."""
    kept, lrs = own_keys(opt.param_groups), [g["lr"] for g in opt.param_groups]
    without, buffers = take_momentum(state_dict)
    refuse_overflow(state_dict["param_groups"], opt.param_groups, buffers)
    refuse_bad_absmax(state_dict["param_groups"], opt.param_groups, buffers)
    refuse_bad_lr(state_dict["param_groups"])
    load(without)
    restore_keys(opt.param_groups, kept)
    adopt_lr(opt.param_groups, lrs)
    put_momentum(opt.state, state_dict["param_groups"], opt.param_groups, buffers)
    return settle_loaded(opt.state, opt.param_groups)


def refuse_overflow(
    saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]], buffers: dict
) -> None:
    """Before anything is loaded: a saved momentum buffer whose conversion to its group's
    ``momentum_dtype`` would turn finite values into inf (float64 or float32 values beyond the
    narrower dtype's range) is refused, naming the buffer and the count of this rank's shard."""
    where = {id(p): (k, i) for k, g in enumerate(groups) for i, p in enumerate(g["params"])}
    saved = chain.from_iterable(g["params"] for g in saved_groups)
    ids = dict(zip(saved, chain(*(g["params"] for g in groups))))
    for key, buf in buffers.items():
        p = ids.get(key)
        if p is None or not isinstance(buf, Tensor):  # no parameter's, or an int8 pair (no overflow)
            continue
        k, i = where[id(p)]
        dtype, local = momentum_dtype(groups[k], p), local_of(buf)
        if dtype == local.dtype or not local.is_floating_point():
            continue
        lost = int((local.isfinite() & ~local.to(dtype).isfinite()).sum())
        if lost:
            name = param_names(groups[k], k)[i]
            raise ValueError(
                f"momentum buffer of '{name}': converting it from {str(local.dtype).removeprefix('torch.')} "
                f"to its group's momentum_dtype {str(dtype).removeprefix('torch.')} would turn {lost} finite "
                f"value(s) of this rank's shard into inf; nothing was loaded. Keep momentum_dtype="
                f"{local.dtype} for its group, or load into an optimizer that keeps it"
            )


def refuse_bad_lr(saved_groups: Sequence[Mapping[str, Any]]) -> None:
    """Before anything is loaded: a saved tensor lr ``adopt_lr`` cannot copy into a group's own
    0-dim tensor (or read as a float)."""
    for k, g in enumerate(saved_groups):
        lr = g.get("lr")
        if isinstance(lr, Tensor) and (lr.dim() != 0 or lr.is_complex()):
            raise ValueError(
                f"param group {k} of the state dict has lr {lr!r}: a tensor lr should be a 0-dim real "
                "tensor; nothing was loaded"
            )


def adopt_lr(groups: Sequence[MutableMapping[str, Any]], own: Sequence[Any]) -> None:
    """After torch's load (which deep-copies the saved groups): each group keeps its own lr object,
    holding the loaded value, so a caller that fills the tensor it passed (docs/design.md's
    capturable recipe, a CUDA graph reading it) still drives the step; a float lr stays a float,
    and a tensor lr saved by a capturable run is read once here."""
    for group, mine in zip(groups, own):
        loaded = group["lr"]
        if isinstance(mine, Tensor):
            with torch.no_grad():
                if isinstance(loaded, Tensor):
                    mine.copy_(loaded.detach())
                else:
                    mine.fill_(loaded)
            group["lr"] = mine
        elif isinstance(loaded, Tensor):
            group["lr"] = float(loaded)


def refuse_bad_absmax(
    saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]], buffers: dict
) -> None:
    """Before anything is loaded: an int8 momentum buffer needs its float32 block maxima beside it,
    of its blocks' shape (``absmax_shape``), finite and >= 0; else the step would fail on its data
    path (or dequantize NaN) with every later call refused. The error names the parameter."""
    ids = dict(
        zip(chain.from_iterable(g["params"] for g in saved_groups), chain(*(g["params"] for g in groups)))
    )
    names = {id(p): n for k, g in enumerate(groups) for p, n in zip(g["params"], param_names(g, k))}
    for key, value in buffers.items():
        buf, absmax = value if isinstance(value, tuple) else (value, None)
        if not isinstance(buf, Tensor) or buf.dtype != torch.int8:
            continue
        p = ids.get(key)
        name = names[id(p)] if p is not None else f"saved parameter {key!r}"
        problem = _absmax_problem(buf, absmax)
        if problem:
            raise ValueError(
                f"int8 momentum of '{name}': its {MOMENTUM_ABSMAX} {problem}; nothing was loaded. Load a "
                "state dict saved with momentum_dtype=torch.int8 as it was saved"
            )


def _absmax_problem(buf: Tensor, absmax: Any) -> str | None:
    if not isinstance(absmax, Tensor):
        return "is missing" if absmax is None else f"is a {type(absmax).__name__}, not a tensor"
    want = absmax_shape(buf.shape)
    if tuple(absmax.shape) != want:
        return f"has shape {tuple(absmax.shape)}, but the buffer's {tuple(buf.shape)} needs {want}"
    local = local_of(absmax)
    if not local.is_floating_point():
        return f"is {absmax.dtype}, not float32"
    bad = int((~(local >= 0) | ~local.isfinite()).sum())
    return f"holds {bad} negative, NaN or infinite value(s)" if bad else None


def own_keys(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each group's ``KEPT_KEYS``, before torch's load replaces them."""
    return [{k: g.get(k) for k in KEPT_KEYS} for g in groups]


def restore_keys(groups: Sequence[MutableMapping[str, Any]], kept: Sequence[Mapping[str, Any]]) -> None:
    """Put back what ``own_keys`` read (a group without names stays without)."""
    for group, own in zip(groups, kept):
        for key, value in own.items():
            if key == "param_names" and value is None:
                group.pop(key, None)
            else:
                group[key] = value


def take_momentum(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[Any, Tensor]]:
    """A state dict for torch's ``load_state_dict`` without momentum buffers, and the buffers by
    saved parameter id: torch casts every floating state tensor to its parameter's dtype, which
    would round a buffer kept wider than its parameter."""
    states = {k: dict(v) if isinstance(v, Mapping) else v for k, v in state_dict["state"].items()}
    buffers = {k: v.pop(MOMENTUM) for k, v in states.items() if isinstance(v, dict) and MOMENTUM in v}
    for k, v in states.items():  # int8 buffers' float32 maxima: kept out of the cast as well
        if isinstance(v, dict) and MOMENTUM_ABSMAX in v:
            buffers[k] = (buffers[k], v.pop(MOMENTUM_ABSMAX))
    return {**state_dict, "state": states}, buffers


def put_momentum(
    state: State,
    saved_groups: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    buffers: dict,
) -> None:
    """After torch's load: the buffers ``take_momentum`` kept, on their parameter's device, each
    parameter matched to its saved id by position (as torch matches them); dtypes stay as saved."""
    ids = dict(
        zip(chain.from_iterable(g["params"] for g in saved_groups), chain(*(g["params"] for g in groups)))
    )
    for key, value in buffers.items():
        p = ids.get(key)
        buf, absmax = value if isinstance(value, tuple) else (value, None)
        where = state[key] if p is None else state[p]  # state of no parameter: kept, as torch keeps it
        where[MOMENTUM] = buf if p is None else buf.to(device=p.device)
        if absmax is not None:
            where[MOMENTUM_ABSMAX] = absmax if p is None else absmax.to(device=p.device)


def settle_loaded(state: State, groups: Sequence[Mapping[str, Any]]) -> list[Conversion]:
    """After torch's ``load_state_dict``: state the checkpoint lacked created again, momentum
    buffers converted to their group's ``momentum_dtype`` (returned: which, from and to what), and
    AdamW's counters (saved on a device, perhaps) on the host as float32, or on the device with
    ``capturable``."""
    converted = []
    for index, group in enumerate(groups):
        converted += init_params(state, group, index, range(len(group["params"])))
    return converted


class StateWalks:
    """``follow_replaced`` and ``init_params`` over every group, run only when what they read
    changed: the parameter set (the checks' generation), a group's algorithm, momentum dtype or
    NorMuon, or the state itself (a load). A steady step compares one small tuple."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None

    def invalidate(self) -> None:
        self._key = None

    def run(
        self,
        state: State,
        groups: Sequence[Mapping[str, Any]],
        seen: dict[int, list[Tensor]],
        generation: int,
    ) -> list[Conversion]:
        """The walks if anything they read changed; the momentum buffers they converted."""
        key = (
            generation,
            id(state),
            [
                (g["algorithm"], g.get("momentum_dtype"), g.get("normuon"), g.get("capturable"))
                for g in groups
            ],
        )
        if key == self._key:
            return []
        follow_replaced(state, groups, seen)
        converted = [
            c for i, g in enumerate(groups) for c in init_params(state, g, i, range(len(g["params"])))
        ]
        self._key = key
        warn_converted(groups, converted, "found")
        return converted


def warn_converted(groups: Sequence[Mapping[str, Any]], conversions: list[Conversion], when: str) -> None:
    """Say which momentum buffers were converted to their group's ``momentum_dtype``, and how to
    keep them as they were."""
    if not conversions:
        return
    shown = [
        f"'{param_names(groups[g], g)[i]}' {str(old).removeprefix('torch.')} -> {str(new).removeprefix('torch.')}"
        for g, i, old, new in conversions
    ]
    more = f" and {len(shown) - 8} more" if len(shown) > 8 else ""
    _, _, saved, _ = conversions[0]
    warn(
        f"momentum buffers {when} in another dtype than their group's momentum_dtype were converted "
        f"to it (a narrower dtype rounds each value once; a wider one is exact): {', '.join(shown[:8])}{more}. "
        f"To keep them as they were, set momentum_dtype={saved} for their group",
    )
