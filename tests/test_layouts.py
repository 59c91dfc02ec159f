"""Every sharding layout gives the one-process step exactly: TP, FSDP x TP, 3-D meshes."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.workers_layouts import blocks_match_dtensor, tp_exactness

LAYOUTS = [
    ((4,), ("tp",)),
    ((2, 2), ("dp", "tp")),
    ((1, 4), ("dp", "tp")),
    ((2, 1, 2), ("replicate", "shard", "tp")),
    ((1, 2, 2), ("replicate", "shard", "tp")),
]


@pytest.mark.parametrize(("mesh_shape", "names"), LAYOUTS, ids=[str(m) for m, _ in LAYOUTS])
def test_tp_layouts_equal_single_process(mesh_shape: tuple, names: tuple) -> None:
    results = run_ranks(tp_exactness, 4, mesh_shape, names)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}: {r['bad']} (placements {r['placements']})"
    if names == ("dp", "tp") and mesh_shape == (2, 2):
        placements = results[0]["placements"]
        assert "_StridedShard" in placements["w1.weight"], placements  # FSDP over colwise TP
        assert placements["w2.weight"] == "(Shard(dim=0), Shard(dim=1))", placements


@pytest.mark.parametrize(("mesh_shape", "names"), LAYOUTS[:3], ids=[str(m) for m, _ in LAYOUTS[:3]])
def test_blocks_are_what_dtensor_holds(mesh_shape: tuple, names: tuple) -> None:
    for rank, bad in enumerate(run_ranks(blocks_match_dtensor, 4, mesh_shape, names)):
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp_checkpoint_resumes_on_fsdp_x_tp(tmp_path) -> None:
    """Saved by FSDP on 4 ranks, resumed by FSDP x TP on a 2x2 mesh: equal gradients make every
    layout the one-process run, so the resumed run ends bitwise where one process ends."""
    from tests.workers_layouts import resume_mlp, save_mlp

    run_ranks(save_mlp, 4, str(tmp_path), (4,), ("dp",), 2)
    for rank, bad in enumerate(run_ranks(resume_mlp, 4, str(tmp_path), (2, 2), ("dp", "tp"), 4)):
        assert bad == [], f"rank {rank}: {bad}"


def test_fsdp_x_tp_training_tracks_single_process() -> None:
    """Real backward passes: TP sums partial products and FSDP averages over dp in other orders than
    one process, so gradients differ by float32 rounding (checked at step 0). Newton-Schulz then
    amplifies bfloat16-level differences along small singular directions (slope up to a^5, about
    490 for Keller's coefficients), so parameters are checked against a few updates' size
    (lr 0.02 x sqrt(2) per step) and the loss against 2e-3."""
    from tests.workers_layouts import train_fsdp_tp

    results = run_ranks(train_fsdp_tp, 4)
    ref = results[0]["ref_losses"]
    assert ref[-1] < ref[0]
    # ranks 0-1 hold the first half of each batch, ranks 2-3 the second: their mean is the batch loss
    mean = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"])]
    assert max(abs(a - b) for a, b in zip(mean, ref)) <= 2e-3, (mean, ref)
    assert max(r["grad_gap"] for r in results) <= 1e-5
    assert max(r["gap"] for r in results) <= 0.03
