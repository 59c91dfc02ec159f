"""Every local input check, once. They depend only on metadata every rank shares (hyperparameters,
global shapes, placements), so every rank raises the same error with no communication. Checks of
per-rank data are the preflight's (``preflight.py``); the Newton-Schulz settings are resolved by
``numerics/ns_config.py``, beside the iteration. Messages are torch.optim's where torch has the
same check.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ..numerics.elementwise import ADJUST_LR
from ..numerics.newton_schulz import NSConfig
from ..numerics.ns_config import NS_DTYPES, NSSplit, ns_dtype_name, resolve_ns_config
from ..sharding.plan.build import MODES, OWNERS, Owners, check_mode
from .param_checks import check_params

__all__ = [
    "NSSplit",
    "Owners",
    "MODES",
    "OWNERS",
    "admit_group",
    "check_adamw_group",
    "check_adamw_momentum_dtype",
    "check_algorithm",
    "check_flags",
    "check_group",
    "check_mode",
    "check_muon_group",
    "check_owners",
    "check_params",
    "check_process_group",
    "check_round_bytes",
    "precheck_group",
    "momentum_dtype_name",
    "normalize_group",
    "refuse_non_member",
    "ns_dtype_name",
    "resolve_ns_config",
]

# float16: refused (momentum_dtype_name); int8: blockwise 8-bit with float32 block maxima (numerics/blockwise.py)
MOMENTUM_DTYPES = ("bfloat16", "float32", "float64", "int8")


def _check_lr(lr: float | Tensor, capturable: bool = False) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")  # torch.optim's message
    if isinstance(lr, Tensor) and lr.dim() != 0:  # a 1-D lr would broadcast inside the step
        raise ValueError(
            f"a tensor lr should be 0-dim (a scalar, e.g. torch.tensor(0.02)) but has shape {tuple(lr.shape)}; "
            "pass lr.reshape(()) to keep one tensor the schedule fills in place, or a float"
        )
    if capturable and isinstance(lr, Tensor):  # its value stays on the device: reading it would sync
        if not lr.is_floating_point():
            raise ValueError(f"a capturable group's tensor lr should be floating point but is {lr.dtype}")
        return
    if not lr >= 0.0:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    _check_finite("lr", lr)


def _check_finite(key: str, value: Any) -> None:
    """An infinite lr, momentum or weight decay can only turn the parameters into NaN."""
    if not value < math.inf:
        raise ValueError(f"{key} should be finite but is: {value}; use a finite value (0 turns it off)")


def _check_bool(key: str, value: Any) -> None:
    """A flag the step reads with ``if``: any other value (a string such as 'no') would be truthy."""
    if not isinstance(value, bool):
        raise ValueError(f"{key} should be True or False but is: {value!r}; pass a bool")


def check_round_bytes(value: Any) -> None:
    """``max_round_bytes``: None for one round per step, else a positive int of bytes."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"max_round_bytes should be None (one round) or an int >= 1 (bytes of full matrices per "
            f"exchange round) but is: {value!r}; the default is 4 << 20"
        )


def check_process_group(group: Any) -> None:
    """``process_group``: where plain-tensor parameters exchange (None: the default group)."""
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(
            f"process_group should be None (the default group) or a torch.distributed.ProcessGroup "
            f"but is: {group!r}; pass a group from dist.new_group or a mesh's get_group()"
        )


def refuse_non_member(group: Any, name: str) -> None:
    """A ValueError naming ``name`` when this rank passed the group torch hands non-members
    (``GroupMember.NON_GROUP_MEMBER``, ``-100``) or None where a group is needed."""
    if group is dist.GroupMember.NON_GROUP_MEMBER or group is None:
        raise ValueError(
            f"{name}: rank {dist.get_rank()} passed a process group it is not a member of (torch.distributed "
            f"gives non-members GroupMember.NON_GROUP_MEMBER, {dist.GroupMember.NON_GROUP_MEMBER}); pass "
            "each rank the group it belongs to (under pipeline parallelism, its own stage's group)"
        )


def check_step_group(group: Any) -> None:
    """``step_group``: the ranks that step together (None: the default group)."""
    if group is not None:
        refuse_non_member(group, "step_group")
    if group is not None and not isinstance(group, (ProcessGroup, DeviceMesh)):
        raise TypeError(
            f"step_group should be None (the default group), a torch.distributed.ProcessGroup or a "
            f"DeviceMesh but is: {group!r}; pass the ranks that call step() together, e.g. a pipeline "
            "stage's mesh"
        )


def check_algorithm(group: dict[str, Any]) -> str:
    """A param group's algorithm, ``"muon"`` when unset."""
    algorithm = group.setdefault("algorithm", "muon")
    if algorithm not in ("muon", "adamw"):
        raise ValueError(f"algorithm should be 'muon' or 'adamw' but is: {algorithm!r}")
    return algorithm


# torchtitan puts fused and foreach in every group: they pick a kernel, not the maths, and Muon has
# one implementation, so they are ignored. These three, if set, would promise a step Muon does not take.
_UNSUPPORTED_FLAGS = {
    "differentiable": "its step runs under torch.no_grad(), so autograd cannot see through it",
    "maximize": "it always minimizes; negate the loss instead",
}


def check_flags(group: Mapping[str, Any], index: int) -> None:
    """Refuse torch.optim flags whose True would silently change the step's meaning."""
    for key, why in _UNSUPPORTED_FLAGS.items():
        if group.get(key):
            raise ValueError(
                f"param group {index} sets {key}={group[key]!r}, which muon_dtensor.Muon does not "
                f"support: {why}. Set it to False or leave it out"
            )


def check_owners(owners: Any) -> None:
    if owners not in OWNERS:
        raise ValueError(
            f"owners should be 'auto', 'mesh' or 'replica' but is: {owners!r}; 'mesh' orthogonalizes "
            "each matrix once over all replicas of an HSDP mesh, 'replica' once in every replica"
        )


def check_split(group: Mapping[str, Any]) -> None:
    """``ns_split``: "off", "auto" or a rank count k >= 2; k only where splits run (``optim/
    policy.py``): the standard iteration, no NorMuon, owner mode."""
    value = group.get("ns_split", "off")
    if value in ("off", "auto") and isinstance(value, str):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(
            f"ns_split should be 'off', 'auto' or a number of ranks >= 2 but is: {value!r}; 'auto' "
            "splits a matrix's Newton-Schulz over several ranks where the cost model says it pays"
        )
    clash = [
        f"{key}={group.get(key, default)!r}"
        for key, default, ok in (("ns_algorithm", "standard", "standard"), ("mode", "owner", "owner"))
        if group.get(key, default) != ok
    ] + (["normuon=True"] if group.get("normuon", False) else [])
    if clash:
        raise ValueError(
            f"ns_split={value} runs the standard iteration in owner mode without NorMuon, but this "
            f"group has {', '.join(clash)}; use ns_split='off' (or 'auto', which splits nothing there)"
        )


def momentum_dtype_name(dtype: Any) -> str | None:
    """``momentum_dtype`` as the name a param group stores: None (the parameter's dtype) or a
    dtype's name from ``MOMENTUM_DTYPES``. The dtype or its name is accepted wherever the value is
    given (the constructor, a group's dict, a group later), as for ``ns_dtype``: the group stores
    the name, so a value read from a group can be given back. float16 is refused: its range ends at 65,504,
    so momentum of gradients near that size overflows to inf with no error, and every parameter it
    touches turns NaN a few steps later; bfloat16 keeps float32's range in the same 2 bytes."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if isinstance(dtype, (str, torch.dtype)) and name == "float16":
        raise ValueError(
            "momentum_dtype=torch.float16 is refused: float16 overflows to inf above 65,504, so the "
            "momentum of large gradients would become inf with no error and the parameters NaN a few "
            "steps later. Pass torch.bfloat16 (the same 2 bytes, float32's range)"
        )
    if isinstance(dtype, (str, torch.dtype)) and name in MOMENTUM_DTYPES:
        return name
    raise ValueError(
        f"momentum_dtype should be None (the parameter's dtype), torch.bfloat16, torch.float32, "
        f"torch.float64 or torch.int8 (or its name, e.g. 'bfloat16') but is: {dtype!r}; pass one of them "
        "(torch.bfloat16 halves the momentum of float32 parameters, torch.int8 keeps a quarter of it in "
        "8-bit blocks)"
    )


def _check_adjust_lr(fn: Any) -> None:
    """A name from ``ADJUST_LR`` (torch's message for others), or a positive finite update RMS."""
    if isinstance(fn, (int, float)) and not isinstance(fn, bool):
        if not 0.0 < fn < math.inf:
            raise ValueError(
                f"adjust_lr_fn as a number is the update RMS to match and must be positive and "
                f"finite, but is: {fn} (Moonshot's match of AdamW is 0.2)"
            )
    elif isinstance(fn, bool) or fn not in ADJUST_LR:
        raise ValueError(
            f"Adjust learning rate function {fn} is not supported: use None, 'original', "
            "'match_rms_adamw', 'spectral' or a positive number (the update RMS to match)"
        )


def check_muon_group(group: Mapping[str, Any]) -> NSConfig:
    """torch.optim.Muon's argument checks, with its messages, and ours; returns the NS config."""
    _check_bool("capturable", group.get("capturable", False))
    _check_lr(group["lr"], group.get("capturable", False))
    if not group["momentum"] >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    _check_finite("momentum", group["momentum"])
    _check_finite("weight_decay", group["weight_decay"])
    _check_muon_flags(group)
    _check_adjust_lr(group["adjust_lr_fn"])
    _check_normuon(group)
    check_mode(group.get("mode", "owner"))
    check_owners(group.get("owners", "auto"))
    check_split(group)
    momentum_dtype_name(group.get("momentum_dtype"))
    dtype = NS_DTYPES[ns_dtype_name(group.get("ns_dtype", "bfloat16"))]
    algorithm = group.get("ns_algorithm", "standard")  # absent from groups saved before it existed
    return resolve_ns_config(group["ns_coefficients"], group["ns_steps"], group["eps"], dtype, algorithm)


def _check_muon_flags(group: Mapping[str, Any]) -> None:
    """The bools and the round size of a Muon group (a group saved before a key existed lacks it)."""
    _check_bool("nesterov", group["nesterov"])
    for key in ("flatten", "experts"):
        _check_bool(f"'{key}'", group.get(key, False))
    check_round_bytes(group.get("max_round_bytes"))


def _check_normuon(group: Mapping[str, Any]) -> None:
    """NorMuon's group options: ``"normuon"`` a bool, ``"beta2"`` (its second moment's decay) in [0, 1)."""
    normuon, beta2 = group.get("normuon", False), group.get("beta2", 0.95)
    if not isinstance(normuon, bool):
        raise ValueError(f"'normuon' should be True or False but is: {normuon!r}")
    if isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0.0 <= beta2 < 1.0:
        raise ValueError(
            f"beta2 (NorMuon's second-moment decay) should be in [0, 1) but is: {beta2!r}; the "
            "official default is 0.95"
        )


def normalize_group(group: MutableMapping[str, Any]) -> None:
    """The one normalization of a group's keys, run by ``admit_group`` and before every step's checks,
    so a value set in a group after construction is the one the constructor stores: a Muon group's
    ``ns_dtype`` and ``momentum_dtype`` as names (``torch.int8`` and ``'int8'`` both become
    ``'int8'``, which the step, the layout checks and the agreement compare). A value no name fits
    is left for the checks to refuse."""
    if group["algorithm"] != "muon":
        return
    for key, name in (("ns_dtype", ns_dtype_name), ("momentum_dtype", momentum_dtype_name)):
        if key in group and isinstance(group[key], torch.dtype):
            group[key] = name(group[key])


def check_group(group: MutableMapping[str, Any], index: int | None = None) -> NSConfig | None:
    """A group's hyperparameters (a user or scheduler may change them between steps), normalized
    first (``normalize_group``); a Muon group's Newton-Schulz config, None for AdamW. ``index``
    names the group in the refusal of an AdamW group's ``momentum_dtype``."""
    normalize_group(group)
    if group["algorithm"] == "adamw":
        check_adamw_group(group)
        check_adamw_momentum_dtype(group, index)
        return None
    return check_muon_group(group)


def check_adamw_group(group: Mapping[str, Any]) -> None:
    """torch.optim.AdamW's argument checks, with its messages."""
    _check_bool("capturable", group.get("capturable", False))
    _check_lr(group["lr"], group.get("capturable", False))
    if not group["eps"] >= 0.0:
        raise ValueError(f"Invalid epsilon value: {group['eps']}")
    beta1, beta2 = group["betas"]
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {group['weight_decay']}")
    _check_finite("weight_decay", group["weight_decay"])
    _check_finite("eps", group["eps"])
    if group.get("normuon", False):
        raise ValueError("'normuon': True is an option of Muon groups; this group is an AdamW group")


def check_adamw_momentum_dtype(group: Mapping[str, Any], index: int | None) -> None:
    """An AdamW group's ``"momentum_dtype"`` would promise moments it does not keep: they stay in
    the parameter's dtype. ``Muon.add_param_group`` stores None there in place of the optimizer's
    default, so any other value was set on the group: in its dict, or later (refused at the step)."""
    if group.get("algorithm") == "adamw" and group.get("momentum_dtype") is not None:
        where = "a param group" if index is None else f"param group {index}"
        raise ValueError(
            f"{where} is an AdamW group and sets 'momentum_dtype': "
            f"{group['momentum_dtype']!r}, an option of Muon groups (AdamW keeps exp_avg and "
            "exp_avg_sq in the parameter's dtype); remove the key from this group (or set it to None)"
        )


def precheck_group(group: dict[str, Any], index: int) -> str:
    """``Muon.add_param_group``'s checks of the user's own dict, before torch adds the defaults: its
    algorithm (returned) and, in an AdamW group, no ``momentum_dtype`` of its own."""
    check_adamw_momentum_dtype(group, index)
    return check_algorithm(group)


def admit_group(group: dict[str, Any], index: int, names: Sequence[str]) -> None:
    """``Muon.add_param_group``'s local checks of group ``index`` (no collective): its flags, its
    settings (dtype names stored as names) and its parameters."""
    check_flags(group, index)
    check_group(group, index)
    check_params(group, names)
