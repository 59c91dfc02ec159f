"""A Muon group's Newton-Schulz settings resolved into an ``NSConfig``: the coefficients (a triple, a
per-step list or a preset name), the step count, eps, the dtype and the algorithm, each checked with
a message that names the value and the fix. It lives beside the iteration so that a new Newton-Schulz
variant is ``numerics/`` alone (CONTRIBUTING.md, "Adding a Newton-Schulz variant"); ``checks/``
calls it for every Muon group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from .newton_schulz import ALGORITHMS, AOL_PRESETS, PRESET_STEPS, PRESETS, NSConfig, Triple

__all__ = ["ALGORITHM_NOTES", "NS_DTYPES", "NSSplit", "ns_dtype_name", "resolve_ns_config"]

# ``ns_split``: Newton-Schulz of one matrix over several ranks: "off", "auto" (the cost model decides,
# ``optim/policy.py``) or a number of ranks.
NSSplit = Literal["off", "auto"] | int

# The Newton-Schulz dtypes by the name a param group stores (plain data in ``state_dict``).
NS_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# What each ``ns_algorithm`` does, for the error that refuses an unknown one: a new variant adds its
# line here and its name to ``newton_schulz.NSAlgorithm`` (tests/numerics/test_ns_config.py holds both).
ALGORITHM_NOTES: dict[str, str] = {
    "standard": "torch's iteration",
    "gram": "the same Newton-Schulz polynomial on the small Gram matrix",
    "aol": "AOL's row scaling instead of the Frobenius division (Turbo-Muon)",
}


def ns_dtype_name(dtype: torch.dtype | str) -> str:
    """``ns_dtype`` as the name a param group stores (plain data in ``state_dict``)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be torch.bfloat16 or torch.float32 but is: {dtype}")
    return name


def _or_list(names: Sequence[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _check_algorithm(algorithm: object) -> None:
    if algorithm not in ALGORITHMS:
        notes = "; ".join(f"{name!r}: {ALGORITHM_NOTES[name]}" for name in ALGORITHMS)
        raise ValueError(f"ns_algorithm should be {_or_list(ALGORITHMS)} but is: {algorithm!r} ({notes})")


def _as_triple(value: Sequence[float]) -> Triple:
    if len(value) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = (float(v) for v in value)
    if not all(math.isfinite(v) for v in (a, b, c)):
        raise ValueError(
            f"ns_coefficients should be finite numbers but hold: {', '.join(map(str, (a, b, c)))}; "
            "use finite (a, b, c) or a preset name"
        )
    return (a, b, c)


def _check_steps_and_eps(ns_steps: object, eps: object) -> None:
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise ValueError(f"ns_steps should be an int (Newton-Schulz iterations, e.g. 5) but is: {ns_steps!r}")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0.0 <= eps < math.inf):
        raise ValueError(
            f"eps should be a finite number >= 0 but is: {eps!r}; it bounds the norm Newton-Schulz "
            "divides by (default 1e-7)"
        )
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if ns_steps < 0:
        raise ValueError(f"ns_steps should be >= 0 but is: {ns_steps}")


def resolve_ns_config(
    ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
    algorithm: str = "standard",
) -> NSConfig:
    """Turn the user's ``ns_coefficients`` (a triple, a per-step list or a preset name) into a config.

    A fixed triple is used for all ``ns_steps`` iterations. A per-step list is used in order; when
    ``ns_steps`` is longer than the list, its last triple repeats (as microsoft/dion does).
    ``algorithm`` is the optimizer's ``ns_algorithm``, one of ``ALGORITHMS``.
    """
    _check_algorithm(algorithm)
    _check_aol_preset(ns_coefficients, algorithm)
    _check_steps_and_eps(ns_steps, eps)
    ns_dtype_name(dtype)
    norm_scale = 1.0
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in PRESETS:
            raise ValueError(
                f"Unknown ns_coefficients preset {ns_coefficients!r}; "
                f"use one of {sorted(PRESETS)} or a tuple (a, b, c)"
            )
        steps, norm_scale = PRESETS[ns_coefficients]
    elif len(ns_coefficients) > 0 and isinstance(ns_coefficients[0], (int, float)):
        steps = (_as_triple(ns_coefficients),)  # type: ignore[arg-type]
    else:
        steps = tuple(_as_triple(t) for t in ns_coefficients)  # type: ignore[arg-type]
        if not steps:
            raise ValueError("Coefficients must be a tuple of exactly 3 values")
    per_step = tuple(steps[min(i, len(steps) - 1)] for i in range(ns_steps))
    return NSConfig(per_step, eps=float(eps), norm_scale=norm_scale, dtype=dtype, algorithm=algorithm)


def _check_aol_preset(ns_coefficients: object, algorithm: str) -> None:
    """A preset fitted to AOL-scaled inputs (``AOL_PRESETS``) runs only after that scaling: by name it
    means Turbo-Muon, not its table after the Frobenius division (a list of its triples runs that)."""
    if isinstance(ns_coefficients, str) and ns_coefficients in AOL_PRESETS and algorithm != "aol":
        raise ValueError(
            f"ns_coefficients={ns_coefficients!r} is fitted to inputs scaled by AOL, but ns_algorithm is "
            f"{algorithm!r}; pass ns_algorithm='aol' with it (and ns_steps={PRESET_STEPS[ns_coefficients]}, "
            "its own count), or pass its triples as a list to run them after the Frobenius division"
        )
