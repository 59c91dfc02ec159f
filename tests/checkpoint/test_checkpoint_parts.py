"""Model parts in one process: lists of parts and optimizers that do not pair up, parts that share an
entry, a model FQN that would read as the optimizer's, and a format-1 folder loaded into parts are
refused before anything is written or loaded; parts saved together load as one model and back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.helpers.pipeline import differences, snapshot, stack
from tests.helpers.stage_layouts import cut, train

FORMAT1 = Path(__file__).resolve().parents[1] / "data" / "format1"


def _parts(seed: int) -> tuple[list[Any], list[Muon]]:
    whole = stack(seed)
    parts = [cut(whole, 2, s) for s in range(2)]
    return parts, [Muon(split_params(p), lr=0.02) for p in parts]


def test_parts_saved_together_load_as_one_model_and_back(tmp_path: Path) -> None:
    parts, opts = _parts(0)
    for p, o in zip(parts, opts):
        train(p, o, range(2))
    ckpt.save_checkpoint(tmp_path / "parts", 2, parts, opts)
    saved = {k: v for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}
    whole = stack(5)
    opt = Muon(split_params(whole), lr=0.02)
    assert ckpt.load_checkpoint(tmp_path / "parts", whole, opt) == {"step": 2}
    assert differences(snapshot(whole, opt), saved) == [] and len(saved) == len(snapshot(whole, opt))
    ckpt.save_checkpoint(tmp_path / "whole", 2, whole, opt)
    again, again_opts = _parts(7)
    ckpt.load_checkpoint(tmp_path / "whole", again, again_opts)
    assert (
        differences({k: v for p, o in zip(again, again_opts) for k, v in snapshot(p, o).items()}, saved) == []
    )


@pytest.mark.parametrize("case", ["unpaired", "shared", "clash"])
def test_parts_that_cannot_be_saved_are_refused_before_any_write(tmp_path: Path, case: str) -> None:
    parts, opts = _parts(0)
    args: tuple[Any, Any]
    if case == "unpaired":
        args, pattern = (
            (parts, opts[:1]),
            r"2 model part\(s\) but 1 optimizer\(s\): pass one optimizer per model part",
        )
    elif case == "shared":
        args, pattern = (
            ([parts[0], parts[0]], [opts[0], opts[0]]),
            r"the model parts hold the same entries: \[",
        )
    else:
        model = nn.ModuleDict({"optimizer": nn.Linear(2, 2)})
        args, pattern = (
            (model, Muon(split_params(model))),
            r"model FQN 'optimizer\.weight' starts with 'optimizer\.'",
        )
    with pytest.raises((ValueError, TypeError), match=pattern):
        ckpt.save_checkpoint(tmp_path, 1, *args)
    assert list(tmp_path.iterdir()) == []


def test_a_format1_folder_loads_into_one_model_only() -> None:
    """tests/data/format1 (written by 0.2.0, groups by index) loads as before into one model; into
    parts it is refused with the way on, nothing loaded."""
    from tests.helpers.models import Net

    parts, opts = _parts(5)
    before = {k: v.clone() for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}
    with pytest.raises(ckpt.CheckpointError, match=r"written before 0\.3\.0 .* not model parts; load it so"):
        ckpt.load_checkpoint(FORMAT1, parts, opts)
    assert differences({k: v for p, o in zip(parts, opts) for k, v in snapshot(p, o).items()}, before) == []
    torch.manual_seed(5)
    model = Net()
    assert ckpt.load_checkpoint(FORMAT1, [model], [Muon(split_params(model))]) == {
        "step": 2,
        "data_position": 12,
    }
