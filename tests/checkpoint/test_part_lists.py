"""Ranks may hold different parts (docs/api.md): part lists that differ between ranks save and load
(issue 41 item 3). The helpers agree on what must be the same everywhere, whether an optimizer was
given and the set of its type names, not on the list's text: ``[opt]`` on one rank and ``opt`` on
another, or two virtual stages on one rank and one on another, were refused with "ranks disagree
about optimizer: "['Muon']" on rank 0, 'Muon' on rank 1". A rank without an optimizer where the
others pass one is still refused (tests/checks/test_one_rank_differs.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.harness.ranks import run_ranks
from tests.helpers.pipeline import differences, snapshot, stack
from tests.helpers.stage_layouts import cut, train


def _parts(case: str, seed: int) -> tuple[Any, Any, list[Any], list[Muon]]:
    """This rank's (model argument, optimizer argument, parts, optimizers) for ``case``."""
    whole = stack(seed)
    if case == "list or not":  # the whole model on both ranks: a list of one here, the part there
        parts = [whole]
    elif dist.get_rank() == 0:  # two virtual stages here (layers 0 and 1), one there (layers 2, 3)
        parts = [cut(whole, 4, 0), cut(whole, 4, 1)]
    else:
        parts = [cut(whole, 2, 1)]
    opts = [Muon(split_params(p), lr=0.02) for p in parts]
    if len(parts) == 1 and dist.get_rank() == 1:
        return parts[0], opts[0], parts, opts
    return parts, opts, parts, opts


def save_and_load(folder: str, case: str, asynchronous: bool) -> list[str]:
    """Rank function: save this rank's parts, load them into fresh ones; the differences."""
    model, optimizer, parts, opts = _parts(case, 0)
    for p, o in zip(parts, opts):
        train(p, o, range(2))
    saved = {k: v for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}
    if asynchronous:
        ckpt.async_save_checkpoint(folder, 2, model, optimizer).wait()
    else:
        ckpt.save_checkpoint(folder, 2, model, optimizer)
    model, optimizer, parts, opts = _parts(case, 5)
    assert ckpt.load_checkpoint(folder, model, optimizer) == {"step": 2}
    loaded = {k: v for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}
    return differences(loaded, saved) + ([] if loaded.keys() == saved.keys() else ["keys"])


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
@pytest.mark.parametrize("case", ["list or not", "two stages or one"])
def test_part_lists_that_differ_between_ranks_save_and_load(
    tmp_path: Path, case: str, asynchronous: bool
) -> None:
    assert run_ranks(save_and_load, 2, str(tmp_path), case, asynchronous, timeout=120) == [[], []]
