"""What ``plan`` and ``plan --check`` accept: the largest inputs, argparse types that refuse a value
naming it and the range, and byte counts in readable units."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "GPUS",
    "LAYERS",
    "MAX_EXPERTS",
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_NS_STEPS",
    "MAX_WIDTH",
    "WIDTH",
    "bounded",
    "format_bytes",
    "seconds_or_rate",
]

# The largest inputs ``plan`` and ``plan --check`` take. Generous for real use: the largest clusters
# have about 10^5 GPUs, the largest models about 10^2 layers, 10^2-10^3 experts, widths and
# vocabularies of 10^4-10^6. Beyond them a check runs for hours (it lays out every matrix on every
# rank) or a shape overflows torch's size arithmetic, so such inputs are refused before any work.
MAX_GPUS = 131072  # 2**17
MAX_LAYERS = 10000
MAX_EXPERTS = 65536
MAX_WIDTH = 2**20  # any one dimension of a matrix: width, MLP size, head size, vocabulary
MAX_NS_STEPS = 1000  # Muon runs 5


def bounded(low: int, high: int, above: str = "", below: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high``; a refusal names the value, the bound
    it crosses and why (``above``, ``below``; argparse puts the flag in front)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value:,} is below {low:,}{below}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{value:,} is above the limit of {high:,}{above}")
        return value

    parse.__name__ = "int"
    return parse


GPUS = bounded(1, MAX_GPUS, ": more GPUs than any cluster has")
LAYERS = bounded(1, MAX_LAYERS, ": more layers than any model has")
WIDTH = bounded(1, MAX_WIDTH, ": wider than any model's matrices (2**20)")


def seconds_or_rate(positive: bool) -> Callable[[str], float]:
    """An argparse ``type``: a finite float, > 0 (a rate) or >= 0 (a time)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number {'> 0' if positive else '>= 0'}")
        return value

    parse.__name__ = "float"
    return parse


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it fills: ``512 B``, ``12.0 KiB``, ``3.4 MiB``, ``1.2 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
