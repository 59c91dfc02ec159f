"""``ns_split``: a matrix's Newton-Schulz over several ranks, in the optimizer's step.

A split step equals, bitwise, the one-process step whose Newton-Schulz is ``split_orthogonalize``
(the same column blocks, the same sums in the same order), on every layout; against the unsplit
one-process step it differs within bfloat16 rounding (tests/numerics/test_split_ns.py states the bound).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard

from muon_dtensor import Muon
from muon_dtensor.numerics.newton_schulz import NSConfig, orthogonalize
from muon_dtensor.numerics.split_ns import split_orthogonalize
from tests.harness import background
from tests.harness.ranks import run_ranks
from tests.helpers.models import full, stepped

# Tall, wide, square, fewer rows than ranks (a Gram matrix of 1 and 3 rows), uneven, same shapes.
SHAPES = [(37, 24), (24, 37), (3, 16), (1, 8), (64, 64), (64, 64), (16, 96), (2, 3)]


def _layouts(world_size: int) -> dict[str, tuple[tuple[int, ...], tuple, dict[str, Any]]]:
    out: dict[str, tuple[tuple[int, ...], tuple, dict[str, Any]]] = {
        "fsdp": ((world_size,), (Shard(0),), {}),
        "fsdp_dim1": ((world_size,), (Shard(1),), {}),
        "replicated": ((world_size,), (Replicate(),), {}),
        # many rounds: gangs in several pipelined rounds, each round's parts together
        "fsdp_rounds": ((world_size,), (Shard(0),), {"max_round_bytes": 600}),
    }
    if world_size == 4:
        out["hsdp_mesh"] = ((2, 2), (Replicate(), Shard(0)), {"owners": "mesh"})
        out["hsdp_replica"] = ((2, 2), (Replicate(), Shard(0)), {"owners": "replica"})
        out["fsdp_tp"] = ((2, 2), (Shard(0), Shard(1)), {})
    return out


def _k(shape: Sequence[int], k: int, group: int) -> int:
    """Ranks a matrix is split over: min(k, the group's ranks), if its long side has that many."""
    k = min(k, group)
    return k if k > 1 and max(shape) >= k else 1


def split_reference(k: int, group: int) -> Callable[[Sequence[Tensor], NSConfig], list[Tensor]]:
    """``split_orthogonalize`` as the one-process optimizer's ``orthogonalize_fn``."""

    def split(mats: Sequence[Tensor], config: NSConfig) -> list[Tensor]:
        return [
            split_orthogonalize(x, _k(x.shape, k, group), config)
            if _k(x.shape, k, group) > 1
            else orthogonalize([x], config)[0]
            for x in mats
        ]

    return split


def _run(mesh_shape: tuple[int, ...] | None, placements: tuple, steps: int, **kw: Any) -> tuple[list, Muon]:
    params, opt = stepped(SHAPES, mesh_shape, lambda i: placements, steps, lambda ps: Muon(ps, lr=0.02, **kw))
    return [full(p.detach()) for p in params] + [full(opt.state[p]["momentum_buffer"]) for p in params], opt


def split_exactness(ks: Sequence[int], steps: int = 2) -> dict[str, Any]:
    """Per layout and k: tensors differing bitwise from the split reference, the largest difference
    from the unsplit step, and the comm figures."""
    world = dist.get_world_size()
    plain, _ = _run(None, (), steps)
    refs: dict[int, list] = {}  # split_reference(k, group) depends on min(k, group) only
    out: dict[str, Any] = {}
    for name, (mesh_shape, placements, kw) in _layouts(world).items():
        group = world if name in ("hsdp_mesh", "fsdp_tp") or len(mesh_shape) == 1 else 2
        for k in ks:
            if min(k, group) not in refs:
                refs[min(k, group)] = _run(None, (), steps, orthogonalize_fn=split_reference(k, group))[0]
            ref = refs[min(k, group)]
            got, opt = _run(mesh_shape, placements, steps, ns_split=k, **kw)
            stats = torch.tensor([opt.comm_stats.orthogonalized])
            dist.all_reduce(stats)
            out[f"{name}/k={k}"] = {
                "differ": [i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)],
                "from_unsplit": max((a - b).abs().max().item() for a, b in zip(got, plain)),
                "orthogonalized": int(stats) // steps,
                "collectives": opt.comm_stats.collectives,
                "replicas": world // group,
            }
    return out


def test_split_step_equals_the_split_reference() -> None:
    _check_split(run_ranks(split_exactness, 2, [2], timeout=300))


@pytest.mark.slow
def test_split_step_equals_the_split_reference_on_4_ranks(split_on_4_ranks: list[Any]) -> None:
    """k = 2, 3 and 4 on 4 ranks, on a pool of its own beside the session's tests (``background.apart``)."""
    _check_split(split_on_4_ranks)


def _check_split(results: list[Any]) -> None:
    for rank, per_case in enumerate(results):
        assert per_case, "no layout was checked"
        for case, r in per_case.items():
            assert r["differ"] == [], f"rank {rank} {case}: tensors {r['differ']} differ from the reference"
            # within bf16 rounding of the unsplit step (lr 0.02, two steps): not bitwise
            assert r["from_unsplit"] < 2e-3, f"rank {rank} {case}: {r['from_unsplit']:.2e} from unsplit"
            # each matrix orthogonalized once per replica group (once in the world with owners="mesh")
            assert r["orthogonalized"] == len(SHAPES) * r["replicas"], f"{case}: {r['orthogonalized']}"
    split = [r["from_unsplit"] for r in results[0].values()]
    assert max(split) > 0, "no split changed a bit: nothing was split"


split_on_4_ranks = background.apart("split_on_4_ranks", split_exactness, 4, [2, 3, 4], timeout=300)


# Pure: the plan's gangs and the policy, without processes.


def _entries(shapes: Sequence[tuple[int, int]], n: int) -> list:
    from muon_dtensor.sharding.plan.blocks import AxisShard, shard_blocks
    from muon_dtensor.sharding.plan.build import MatrixEntry

    return [MatrixEntry(s, shard_blocks(s, [AxisShard(0, 0, n)])) for s in shapes]


def test_gangs_take_aligned_ranks_and_stay_in_one_round() -> None:
    from muon_dtensor.optim.policy import SplitPolicy
    from muon_dtensor.sharding.plan.blocks import AxisShard, shard_blocks
    from muon_dtensor.sharding.plan.domains import build_domain, group_members
    from muon_dtensor.sharding.plan.param_layout import ParamLayout
    from muon_dtensor.sharding.plan.routes import build_routes
    from muon_dtensor.sharding.plan.views import matrix_views

    n, shapes = 16, [(512, 2048)] * 3 + [(64, 64)] * 20 + [(2048, 512)]
    layouts, views = [], []
    for s in shapes:
        blocks = shard_blocks(s, [AxisShard(0, 0, n)])
        layouts.append(ParamLayout(None, (0,), blocks, 5, None))
        views.append(matrix_views(s, blocks, 5, name="w"))
    (members,) = group_members(layouts, views)
    ks = SplitPolicy(4).ks([view.shape for _, view in members], n)
    domain = build_domain(members, layouts, ks, "owner", 300_000)
    plan = domain.plan
    assert len(plan.gangs) == len(shapes)  # every matrix has a long side >= 4
    for gang in plan.gangs:
        k = len(gang.parts)
        assert (
            k == 4 and gang.ranks[0] % k == 0 and gang.ranks == tuple(range(gang.ranks[0], gang.ranks[0] + k))
        )
        rounds = [r for r in plan.rounds if set(gang.parts) & set(r.members)]
        assert len(rounds) == 1 and set(gang.parts) <= set(rounds[0].members), "a gang spans rounds"
        assert [rounds[0].owners[rounds[0].members.index(p)] for p in gang.parts] == list(gang.ranks)
    assert len(plan.rounds) > 1
    # every rank's route names the same gangs in each round (all join their collectives)
    routes = [build_routes(plan, me) for me in range(n)]
    for i in range(len(plan.rounds)):
        seen = {split.gangs if (split := r[i].split) else () for r in routes}
        assert len(seen) == 1


def test_auto_splits_only_where_the_model_says_it_pays() -> None:
    from muon_dtensor.optim.policy import SplitPolicy
    from muon_dtensor.planning.costmodel import LLAMA3_70B

    shapes = list(LLAMA3_70B)
    auto = SplitPolicy("auto")
    assert max(auto.ks(shapes, 1024)) > 1, "70B at 1,024 ranks: the largest matrices split"
    assert auto.ks(shapes, 8) == [1] * len(shapes), "70B at 8 ranks: nothing pays"
    assert auto.ks([(64, 64)] * 4, 4) == [1] * 4
    assert SplitPolicy("off").ks(shapes, 1024) == [1] * len(shapes)
    assert SplitPolicy(4).ks([(3, 2), (4, 1), (64, 64)], 2) == [2, 2, 2]  # capped at the group
    assert SplitPolicy(4).ks([(3, 2), (64, 64)], 4) == [1, 4]


@pytest.mark.parametrize(
    ("value", "extra", "match"),
    [
        (1, {}, "number of ranks >= 2"),
        (True, {}, "number of ranks >= 2"),
        ("yes", {}, "'off', 'auto'"),
        (2.0, {}, "number of ranks >= 2"),
        (2, {"normuon": True}, "normuon=True"),
        (2, {"ns_algorithm": "gram"}, "ns_algorithm='gram'"),
        (2, {"mode": "gather"}, "mode='gather'"),
    ],
)
def test_bad_ns_split_is_refused_with_the_fix(value: Any, extra: dict[str, Any], match: str) -> None:
    w = nn.Parameter(torch.randn(4, 4))
    if "normuon" not in extra:  # a group key only
        with pytest.raises(ValueError, match=match):
            Muon([w], ns_split=value, **extra)
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [w], "ns_split": value, **extra}])
