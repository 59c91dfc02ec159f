"""The grid a small sum over many ranks runs through: gloo's all-reduce sends even a few integers twice
around a ring of P ranks (``gloo/allreduce.cc``), 4 (P - 1) sequential hops, so the step's check over
8,192 ranks would take 32,764 hops. Summed axis by axis over a grid of at most ``GRID_SIDE`` ranks a
side, every rank's row still reaches every rank once, in 4 sum(side - 1) hops (508 at 8,192 ranks).
Pure: ``runtime.groups.check_groups`` creates the groups, ``planning`` prices the hops."""

from __future__ import annotations

__all__ = ["GRID_ABOVE", "GRID_SIDE", "grid_axis", "grid_factors", "ring_hops"]

GRID_ABOVE = 256  # groups of more ranks than this sum over a grid; smaller ones in one all-reduce
GRID_SIDE = 64


def grid_factors(size: int, above: int | None = None, side: int | None = None) -> tuple[int, ...]:
    """The sides of the grid over ``size`` ranks, largest divisors first, each at most ``side``
    (``GRID_SIDE``); () for one all-reduce (``size`` at most ``above``, ``GRID_ABOVE``, or no divisor
    up to ``side``)."""
    above = GRID_ABOVE if above is None else above
    side = GRID_SIDE if side is None else side
    if size <= above:
        return ()
    out, rest = [], size
    while rest > side:
        d = next((d for d in range(side, 1, -1) if rest % d == 0), None)
        if d is None:
            return ()
        out.append(d)
        rest //= d
    return (*out, rest) if rest > 1 else tuple(out)


def grid_axis(factors: tuple[int, ...], index: int, axis: int) -> list[int]:
    """The indices (row-major over ``factors``) that share every coordinate of ``index`` but ``axis``'s."""
    stride = 1
    for f in factors[axis + 1 :]:
        stride *= f
    base = index - (index // stride % factors[axis]) * stride
    return [base + j * stride for j in range(factors[axis])]


def ring_hops(size: int, above: int | None = None, side: int | None = None) -> int:
    """Sequential hops of a small ring all-reduce over ``size`` ranks, through the grid where one is used."""
    return sum(4 * (f - 1) for f in grid_factors(size, above, side) or (size,))
