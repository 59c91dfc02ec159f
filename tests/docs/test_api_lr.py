"""docs/api.md said ``lr`` is a "float or 1-element tensor" while a 1-D tensor is refused (issue 49
item 7): the row now says 0-dim, and this holds the page to the check."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from muon_dtensor import Muon

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_lr_row_says_what_the_check_accepts() -> None:
    row = next(line for line in API.read_text().splitlines() if line.startswith("| `lr` |"))
    assert "0-dim tensor" in row and "1-element" not in row, row
    p = nn.Parameter(torch.ones(4, 4))
    Muon([p], lr=torch.tensor(0.02))  # 0-dim: accepted
    with pytest.raises(ValueError, match=re.escape("a tensor lr should be 0-dim")):
        Muon([p], lr=torch.tensor([0.02]))
