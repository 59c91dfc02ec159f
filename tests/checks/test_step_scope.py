"""The step group's agreement on meshes (``checks/step_scope.py``): the fingerprint is 0 exactly when
every rank of every scope steps on it, checked for 1,024 ranks without a process; then on 2 gloo
ranks, a rank lacking a mesh is the documented error on every rank, and ``step_group`` is checked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from muon_dtensor import Muon
from muon_dtensor.checks.step_scope import _SEEDS, PRIME, _term, agreed, describe
from tests.harness.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _key(ranks: list[int], name: str) -> tuple:
    return ("mesh", "cpu", (len(ranks),), (name,), tuple(ranks))


def _total(uses: dict[int, list[tuple]]) -> list[int]:
    """The step group's summed pieces when each rank adds its terms for the scopes it uses."""
    return [sum(sum(_term(k, r, seed) for k in keys) % PRIME for r, keys in uses.items()) for seed in _SEEDS]


def _grid(side: int) -> dict[int, list[tuple]]:
    """Ranks of a side x side (dp, tp) mesh: each uses its row, its column and the whole mesh."""
    everything = _key(list(range(side * side)), "all")
    return {
        r: [
            _key([r // side * side + c for c in range(side)], "tp"),
            _key(list(range(r % side, side * side, side)), "dp"),
            everything,
        ]
        for r in range(side * side)
    }


def test_every_rank_on_its_meshes_sums_to_zero_for_1024_ranks() -> None:
    assert agreed(_total(_grid(32)))


@pytest.mark.parametrize("change", ["lacks its row", "lacks the whole mesh", "steps on another row too"])
def test_one_rank_of_1024_that_differs_is_seen(change: str) -> None:
    uses = _grid(32)
    rank = random.Random(change).randrange(1024)
    if change == "lacks its row":
        uses[rank] = uses[rank][1:]
    elif change == "lacks the whole mesh":
        uses[rank] = uses[rank][:2]
    else:
        uses[rank] = [*uses[rank], uses[(rank + 32) % 1024][0]]
    assert not agreed(_total(uses))


def test_the_description_names_the_mesh_and_the_ranks() -> None:
    mesh = _key([0, 1], "extra")
    assert (
        describe({0: [], 1: [mesh]})
        == "the cpu mesh (extra=2) of ranks [0, 1] is stepped on by rank(s) [1] but not by [0]"
    )


def test_a_rank_lacking_a_mesh_is_the_documented_error_on_every_rank() -> None:
    results = run_ranks(lacking_mesh, 2, timeout=60)
    assert results[0] == results[1], results
    assert results[0][0] == "ValueError"
    docs = " ".join((ROOT / "docs" / "unsupported.md").read_text().split())
    assert f"`ValueError: {results[0][1]}`" in docs, results[0][1]


def test_step_group_of_another_type_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="step_group should be None .* but is: 'world'"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], step_group="world")  # type: ignore[arg-type]


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def lacking_mesh() -> tuple[str, str]:
    """Both ranks step on the model's mesh; rank 1 alone also on a second one."""
    world = dist.get_world_size()
    meshes = (
        init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
        init_device_mesh("cpu", (world,), mesh_dim_names=("extra",)),
    )
    params = []
    for mesh in meshes[: 1 + dist.get_rank()]:
        p = nn.Parameter(DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False))
        p.grad = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
        params.append(p)
    opt = Muon(params, lr=0.02)
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return "no error", ""
