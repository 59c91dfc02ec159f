"""The steps a small sum over many ranks runs through: gloo's all-reduce sends even a few integers
twice around a ring of P ranks (``gloo/allreduce.cc``), 4 (P - 1) sequential hops, so the step's check
over 8,192 ranks would take 32,764 hops. Above ``GRID_ABOVE`` ranks it runs as a butterfly
(recursive doubling) of two-rank sums instead: in step k a rank sums with the rank whose index differs
in bit k, so after log2 P steps every rank holds the sum of every row. Each step is an all-gather of
the two rows (one message each way; ``runtime.comm``), 13 steps at 8,192 ranks, each priced as
measured (``planning.hardware.GLOO_PAIR_STEP_SECONDS``). A rank count that is not a power of two
folds its last ``P - 2**k`` ranks into the first ones before and hands them the total after: two
steps more. Every rank ends with the same integers, and
with the same bits for floats too (each step adds the same two values, in either order).
Pure: ``runtime.groups.check_groups`` creates the groups, ``planning`` prices the steps."""

from __future__ import annotations

__all__ = ["GRID_ABOVE", "Step", "butterfly_steps", "ring_hops"]

GRID_ABOVE = 256  # groups of more ranks than this sum through the butterfly; smaller ones in one all-reduce

# One step of a rank: the two group indices (sorted) that sum together, and whether this rank adds
# nothing (the total handed back to a folded rank: it brings zeros to a sum, its own value to a max)
Step = tuple[tuple[int, int], bool]


def butterfly_steps(size: int, index: int, above: int | None = None) -> list[Step]:
    """The steps of index ``index`` in a sum over ``size`` ranks; [] for one all-reduce (``size`` at
    most ``above``, ``GRID_ABOVE``)."""
    if size <= (GRID_ABOVE if above is None else above) or size < 2:
        return []
    base = 1 << (size.bit_length() - 1)  # the largest power of two up to size
    if index >= base:  # folded: its row goes to index - base, the total comes back from it
        pair = (index - base, index)
        return [(pair, False), (pair, True)]
    fold: list[Step] = [((index, index + base), False)] if index + base < size else []
    rounds: list[Step] = []
    bit = 1
    while bit < base:
        rounds.append(((min(index, index ^ bit), max(index, index ^ bit)), False))
        bit <<= 1
    return fold + rounds + fold


def ring_hops(size: int) -> int:
    """Sequential hops of gloo's ring all-reduce of a few integers over ``size`` ranks, 4 (P - 1):
    the check's sum up to ``GRID_ABOVE`` ranks, where it takes no butterfly."""
    return 4 * (size - 1)
