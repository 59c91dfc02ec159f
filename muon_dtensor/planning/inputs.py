"""What ``plan`` accepts, as data: the largest inputs, the mesh shape ``gpus = replicate x shard``
(``Layout``, checked by ``layout``) and byte counts in readable units. The flags that read them are
``tools/plan_flags.py``'s."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MAX_EXPERTS",
    "MAX_GPUS",
    "MAX_LAYERS",
    "MAX_NS_STEPS",
    "MAX_WIDTH",
    "Layout",
    "format_bytes",
    "layout",
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


@dataclass(frozen=True)
class Layout:
    """``gpus`` = ``replicate`` replica groups x ``shard`` ranks per shard group."""

    gpus: int
    shard: int
    replicate: int


def layout(gpus: int | None, shard: int | None, replicate: int | None) -> Layout:
    """The mesh shape from any two of ``gpus``, ``shard`` and ``replicate`` (or ``gpus`` alone: one
    shard group); ValueError naming the flags (``--gpus``, ``--shard``, ``--replicate``) otherwise."""
    if gpus is None and shard is None:
        raise ValueError("give --gpus, or --shard (and --replicate)")
    if any(v is not None and v < 1 for v in (gpus, shard, replicate)):
        raise ValueError("--gpus, --shard and --replicate must be >= 1")
    if gpus is None:
        assert shard is not None
        return _within(Layout(shard * (replicate or 1), shard, replicate or 1))
    for flag, size in (("--shard", shard), ("--replicate", replicate)):
        if size is not None and gpus % size:
            raise ValueError(f"--gpus {gpus} is not a multiple of {flag} {size}")
    if shard is None:
        shard = gpus // (replicate or 1)
    replicate = replicate or gpus // shard
    if shard * replicate != gpus:
        raise ValueError(f"--gpus {gpus} is not --shard {shard} x --replicate {replicate}")
    return _within(Layout(gpus, shard, replicate))


def _within(found: Layout) -> Layout:
    if found.gpus > MAX_GPUS:
        raise ValueError(
            f"--shard {found.shard} x --replicate {found.replicate} = {found.gpus:,} GPUs is above the "
            f"limit of {MAX_GPUS:,}: more GPUs than any cluster has"
        )
    return found


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it fills: ``512 B``, ``12.0 KiB``, ``3.4 MiB``, ``1.2 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
