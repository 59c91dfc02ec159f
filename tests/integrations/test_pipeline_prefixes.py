"""The pipeline helpers' arguments (issue 49 item 7): ``keep_prefixes(m, [""])`` removed every module
(the empty prefix matched nothing below the root, yet named the root, so it passed the check), and
``even_prefixes(-4, 2)`` was accepted (a negative multiple of the stage count). Both are refused,
naming the value; the ordinary cuts are unchanged."""

from __future__ import annotations

import pytest
from torch import nn

from muon_dtensor.integrations.pipeline import even_prefixes, keep_prefixes


def _model() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Linear(2, 2)
    model.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(4)})
    model.head = nn.Linear(2, 2)
    return model


def test_the_empty_prefix_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match='prefixes holds "", which names the whole model'):
        keep_prefixes(model, ["layers.0", ""])
    assert len(list(model.parameters())) == 12  # nothing was removed


def test_keep_prefixes_cuts_a_stage() -> None:
    part = keep_prefixes(_model(), ["embed", "layers.0", "layers.1"])
    names = [n for n, _ in part.named_parameters()]
    assert names == [
        "embed.weight",
        "embed.bias",
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]


@pytest.mark.parametrize(
    ("layers", "stages", "match"),
    [
        (-4, 2, "layers should be a positive multiple of stages 2 but is -4"),
        (0, 2, "layers should be a positive multiple of stages 2 but is 0"),
        (5, 2, "layers should be a positive multiple of stages 2 but is 5"),
        (4.0, 2, "layers should be a positive multiple of stages 2 but is 4.0"),
        (4, 0, "stages should be an int of at least 1 but is 0"),
        (4, -2, "stages should be an int of at least 1 but is -2"),
    ],
)
def test_even_prefixes_refuses_bad_counts(layers: object, stages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        even_prefixes(layers, stages, first=["embed"], last=["head"])  # type: ignore[arg-type]


def test_even_prefixes_splits_evenly() -> None:
    assert even_prefixes(4, 2, first=["embed"], last=["head"], every=["rope"]) == [
        ["rope", "embed", "layers.0", "layers.1"],
        ["rope", "layers.2", "layers.3", "head"],
    ]
