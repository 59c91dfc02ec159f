"""Every bad input raises on every rank, names the parameter, and finishes within a timeout."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.workers_bad import no_grad_anywhere_is_skipped, run_case

CASES = [
    ("grad_on_some_ranks", "RuntimeError", r"'blocks.1.w' has a gradient on 1 of 2 rank"),
    ("sparse_grad_on_one_rank", "RuntimeError", r"sparse gradients: 'head.w' has one on 1 of 2"),
    ("mislaid_grad_on_one_rank", "ValueError", r"gradient of 'blocks.0.w' is not laid out like"),
    ("params_on_two_meshes", "ValueError", r"different meshes \('a.w' on .*'b.w' on"),
    ("non_2d_dtensor", "ValueError", r"only supports 2D parameters.*'blocks.0.conv'.*adamw"),
    ("complex_dtensor", "RuntimeError", r"does not support complex parameters: 'rot.w'"),
    ("partial_param", "ValueError", r"'odd.w' has placements \(Partial"),
    ("negative_lr_at_step", "ValueError", r"Learning rate should be >= 0 but is: -0.5"),
    ("unknown_preset", "ValueError", r"Unknown ns_coefficients preset 'kellr'"),
]


@pytest.mark.parametrize(("case", "error", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_on_every_rank(case: str, error: str, pattern: str) -> None:
    results = run_ranks(run_case, 2, case, timeout=60)
    for rank, (kind, message) in enumerate(results):
        assert kind == error, f"rank {rank} raised {kind}: {message}"
        assert __import__("re").search(pattern, message), f"rank {rank}: {message}"


def test_rank_outside_a_parameters_mesh_raises_there_only() -> None:
    (kind0, message0), (kind1, message1) = run_ranks(run_case, 2, "rank_outside_mesh", timeout=60)
    assert (kind0, message0) == ("none", "")
    assert kind1 == "ValueError" and "'stage0.w'" in message1 and "rank 1 is not part of its mesh" in message1


def test_parameter_without_gradient_anywhere_is_skipped() -> None:
    assert run_ranks(no_grad_anywhere_is_skipped, 2, timeout=60) == [True, True]
