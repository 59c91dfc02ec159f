"""torch's ``fake`` backend is a supported backend: one process plays one rank of a world of any size
(``runtime.comm.simulated``). On a fake group the agreement treats every rank as this one, so
``Muon`` (step, describe, memory, metrics), ``qk_clip_`` / ``qk_clip_all_`` and the checkpoint
helpers' agreement run with no patch; and an all-to-all where this rank sends nothing works on fake
and on gloo.

Regression: ``Muon.step`` raised "ranks disagree about the meshes they step on" on a fake group (the
checks summed per-rank rows, and the fake all-reduce returns this rank's row), and with the checks
patched out the exchange raised in torch's fake all-to-all ("inputBuffer is empty but
outputSplitSizes[0] > 0") on a rank that sends nothing but receives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from muon_dtensor import Muon, qk_clip_, qk_clip_all_
from muon_dtensor.checkpoint.arguments_agree import agree, agree_save
from muon_dtensor.checks.together import raise_together
from muon_dtensor.sharding.runtime.comm import CommStats, simulated, start_exchange
from muon_dtensor.testing import run_ranks as fresh_ranks
from tests.harness.ranks import run_ranks


@pytest.fixture
def fake_world(request: pytest.FixtureRequest) -> Iterator[tuple[int, int]]:
    """A fake default group for ``(rank, world)`` (the test's param), destroyed after."""
    rank, world = getattr(request, "param", (5, 64))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield rank, world
    finally:
        dist.destroy_process_group()


def _local(shape: tuple[int, int], mesh: DeviceMesh, placements: list, fill: float = 1.0) -> DTensor:
    """A DTensor holding this rank's real local shard of a ``shape`` matrix (filled with ``fill``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    gen = torch.Generator().manual_seed(len(shape) + shape[0])
    local = torch.randn(local_shape, generator=gen) * fill
    return DTensor.from_local(
        local, mesh, placements, shape=torch.Size(shape), stride=(shape[1], 1), run_check=False
    )


def _params(mesh: DeviceMesh, placements: list, shapes: list[tuple[int, int]]) -> list[Any]:
    out = []
    for shape in shapes:
        p = nn.Parameter(_local(shape, mesh, placements))
        p.grad = _local(shape, mesh, placements, 0.5)
        out.append(p)
    return out


SHAPES = [(96, 64), (64, 96), (40, 64), (200, 64), (3, 64)]  # 3 rows: most ranks hold nothing


@pytest.mark.parametrize("fake_world", [(0, 64), (5, 64), (63, 64)], indirect=True)
def test_muon_on_fake_fsdp(fake_world: tuple[int, int]) -> None:
    rank, world = fake_world
    assert simulated(None) and simulated(dist.group.WORLD)
    mesh = init_device_mesh("cpu", (world,))
    params = _params(mesh, [Shard(0)], SHAPES)
    before = [p.to_local().clone() for p in params]
    opt = Muon(params, lr=0.02)
    for _ in range(2):
        opt.step()
    assert opt.comm_stats.collectives > 0  # the exchange ran (this rank sends or receives blocks)
    moved = [not torch.equal(p.to_local(), b) for p, b in zip(params, before)]
    assert all(moved[i] for i, p in enumerate(params) if p.to_local().numel())
    assert "muon" in opt.describe().lower()
    assert opt.memory()["peak_transient"] >= 0
    local, job = opt.metrics(), opt.metrics(reduce=True)
    assert job["muon/collectives"] == world * local["muon/collectives"]  # every rank as this one


@pytest.mark.parametrize("fake_world", [(70, 128)], indirect=True)
def test_muon_on_fake_hsdp_and_tp(fake_world: tuple[int, int]) -> None:
    _, world = fake_world
    hsdp = init_device_mesh("cpu", (4, world // 4), mesh_dim_names=("rep", "shard"))
    tp = init_device_mesh("cpu", (world // 8, 8), mesh_dim_names=("dp", "tp"))
    params = _params(hsdp, [Replicate(), Shard(0)], SHAPES[:3]) + _params(
        tp, [Shard(0), Shard(1)], SHAPES[:2]
    )
    opt = Muon(params, lr=0.02)
    opt.step()
    opt.step()
    assert opt.describe()


@pytest.mark.parametrize("fake_world", [(3, 16)], indirect=True)
def test_agreement_on_fake_treats_every_rank_as_this_one(fake_world: tuple[int, int]) -> None:
    raise_together(None, None, "call", {"step": 3})  # agrees: every rank is this one
    with pytest.raises(KeyError, match="mine"):  # this rank's failure is every rank's
        raise_together(KeyError("mine"), None, "call", {"step": 3})
    assert agree("load", None, lambda: (7, {"files": 2}), step=1) == 7
    assert agree_save(None, lambda: "state", step=1) == "state"
    with pytest.raises(ValueError, match="bad root"):

        def bad() -> str:
            raise ValueError("bad root")

        agree_save(None, bad, step=1)


@pytest.mark.parametrize("fake_world", [(9, 32)], indirect=True)
def test_qk_clip_on_fake(fake_world: tuple[int, int]) -> None:
    _, world = fake_world
    mesh = init_device_mesh("cpu", (world,))
    q, k = _local((64, 32), mesh, [Replicate()]), _local((32, 32), mesh, [Replicate()])
    logits = torch.tensor([500.0, 1.0, 50.0, 2.0])
    qk_clip_(q, k, logits, head_dim=16, threshold=100.0)
    factors = qk_clip_all_({"a": (q, k, logits)}, head_dim=16, threshold=100.0)
    assert float(factors[0].q[0]) < 1.0


@pytest.mark.parametrize("fake_world", [(2, 4)], indirect=True)
def test_exchange_sending_nothing_on_fake(fake_world: tuple[int, int]) -> None:
    """This rank sends nothing and receives from two others: the received segments come back whole."""
    group = dist.group.WORLD
    assert group is not None
    finish = start_exchange(torch.empty(0), [0, 0, 0, 0], [3, 0, 0, 2], group=group, stats=CommStats())
    assert finish().shape == (5,)
    finish = start_exchange(torch.empty(0), [0, 0, 0, 0], [3, 4, 0, 0], group=group)
    assert finish().shape == (7,)  # the padding (this rank's own slot) sits between segments


def _sends_nothing() -> list[float]:
    """Rank 0 sends nothing and receives ``rank`` from every other rank (gloo)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None and not simulated(group)
    send = torch.empty(0) if rank == 0 else torch.full((2,), float(rank))
    sends = [0] * world if rank == 0 else [2] + [0] * (world - 1)
    recvs = [0] + [2] * (world - 1) if rank == 0 else [0] * world
    return start_exchange(send, sends, recvs, group=group)().tolist()


def test_exchange_sending_nothing_on_gloo() -> None:
    results = run_ranks(_sends_nothing, 4)
    assert results[0] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert results[1:] == [[], [], []]


def _mixed() -> list[float]:
    """A real gloo job whose mesh has a fake degree-1 axis (torchtitan's meshes do): steps together."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"), backend_override={"tp": "fake"})
    assert simulated(mesh.get_group("tp")) and not simulated(mesh.get_group("dp"))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=gen)
    from torch.distributed.tensor import distribute_tensor

    p: Any = nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Replicate()]))
    p.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0), Replicate()])
    opt = Muon([p], lr=0.02)
    opt.step()
    opt.step()
    return p.full_tensor().flatten().tolist()


def test_mixed_backends_fake_degree_one_axis() -> None:
    results = run_ranks(_mixed, 2)
    assert results[0] == results[1]
    p = nn.Parameter(torch.randn(8, 6, generator=torch.Generator().manual_seed(0)))
    opt = Muon([p], lr=0.02)
    for _ in range(2):
        p.grad = torch.ones(8, 6)
        opt.step()
    assert results[0] == p.detach().flatten().tolist()  # bitwise the one-process step


def _setup_work(rank: int, world: int, layers: int) -> tuple[int, int]:
    """Mesh reads and view blocks cut by one set-up of ``layers`` x 3 matrices on ``world`` ranks."""
    from muon_dtensor.sharding.plan import param_layout, views

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        params = _params(mesh, [Shard(0)], [(256, 64), (64, 256), (128, 64)] * layers)
        reads, cuts = param_layout.MESH_READS[0], views.VIEW_BLOCK_CUTS[0]
        Muon(params, lr=0.02).step()
        return param_layout.MESH_READS[0] - reads, views.VIEW_BLOCK_CUTS[0] - cuts
    finally:
        dist.destroy_process_group()


def test_setup_work_is_params_plus_world() -> None:
    """Counted, not timed: a set-up reads each mesh once whatever the parameter count or world, and
    cuts each layout's blocks once (O(world)), not once per parameter (O(params x world)). Before,
    every parameter read ``DeviceMesh.mesh`` once per group rank and cut every rank's blocks."""
    reads, cuts = _setup_work(7, 256, 2)
    more_params = _setup_work(7, 256, 8)
    more_ranks = _setup_work(7, 512, 2)
    assert max(reads, more_params[0], more_ranks[0]) <= 1  # 0: torch handed back a mesh already read
    assert cuts <= 3 * 256 and more_params[1] <= 3 * 256  # 4x the parameters: no more work
    assert more_ranks[1] == 3 * 512  # 2x the world: the O(world) part only


# Issue 49 item 4: a fake group inside a real job switched the agreement off. A fake mesh axis of two
# ranks in a gloo job stepped with wrong weights (each rank took its own values for both ranks'),
# ``Muon(step_group=<a fake group>)`` let lr 0.02 against 0.03 through, and a mesh only rank 0
# stepped on ended in a gloo abort. Each is now refused on every rank before any collective; the
# degree-1 fake axes of torchtitan's meshes keep working (``test_mixed_backends_fake_degree_one_axis``).
# Fresh processes: torch keeps a mesh's fake group for a later mesh over the same ranks.


def _fake_dp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",), backend_override={"dp": "fake"})


def _sharded(mesh: DeviceMesh) -> Any:
    """A parameter sharded on ``mesh``, built from local shards (no collective: ranks may differ)."""
    return _params(mesh, [Shard(0)], [(8, 6)])[0]


def _outcome(p: Any, run: Callable[[], object]) -> tuple[str, str, bool]:
    """``run()``'s outcome: (error type or "no error", message, whether ``p``'s local shard is unchanged)."""
    before = p.to_local().clone()
    try:
        run()
        kind, message = "no error", ""
    except ValueError as e:
        kind, message = type(e).__name__, str(e)
    return kind, message, torch.equal(p.to_local(), before)


def _refused_fake(case: str) -> tuple[str, str, bool]:
    """One case: (error type, message, whether this rank's weights are unchanged)."""
    rank = dist.get_rank()
    real = init_device_mesh("cpu", (2,))
    p = _sharded(_fake_dp_mesh() if case in ("fake mesh axis", "only rank 0 steps", "qk_clip") else real)

    def run() -> None:
        if case == "fake step_group":
            Muon([p], lr=0.02 + 0.01 * rank, step_group=dist.new_group(backend="fake")).step()
        elif case == "only rank 0 steps":  # rank 1 steps on plain tensors, over the same step group
            mine = [p] if rank == 0 else [nn.Parameter(torch.ones(4, 4))]
            Muon(mine, lr=0.02, step_group=dist.group.WORLD).step()
        elif case == "qk_clip":
            qk_clip_(p, p, torch.tensor([500.0]), head_dim=8, threshold=100.0)
        else:
            Muon([p], lr=0.02).step()

    return _outcome(p, run)


def _fake_step_sum() -> tuple[str, str, bool]:
    """Rank 0 steps on a fake 2-rank mesh axis, rank 1 on a real mesh, both in the default group's
    row (no step_group: the refusal travels in the step's first sum)."""
    rank = dist.get_rank()
    real, fake = init_device_mesh("cpu", (2,)), _fake_dp_mesh()
    p = _sharded(fake if rank == 0 else real)
    return _outcome(p, lambda: Muon([p], lr=0.02).step())


FAKE_CASES = ["fake mesh axis", "fake step_group", "only rank 0 steps", "qk_clip", "one rank's mesh"]


def fake_cases() -> list[tuple[str, str, bool]]:
    """Rank function: every case, in one launch (each builds its own meshes and groups)."""
    return [_fake_step_sum() if case == "one rank's mesh" else _refused_fake(case) for case in FAKE_CASES]


def test_a_fake_group_of_several_ranks_in_a_real_job_is_refused_on_every_rank() -> None:
    """Each case raises the same ValueError on both ranks, and no weight moves. "only rank 0 steps"
    is refused where Muon is built; "one rank's mesh" (once a gloo abort on rank 1) in the step
    group's sum, which names the mesh rank 1 lacks."""
    ranks = fresh_ranks(fake_cases, 2, timeout=120)
    for case, *results in zip(FAKE_CASES, *ranks, strict=True):
        assert all(kind == "ValueError" and unchanged for kind, _, unchanged in results), (case, results)
        assert results[0] == results[1], (case, results)
        message = results[0][1]
        if case == "one rank's mesh":
            assert (
                "the cpu mesh (dp=2) of ranks [0, 1] is stepped on by rank(s) [0] but not by [1]" in message
            )
        else:
            assert "runs on torch's fake backend over 2 ranks" in message, (case, message)
            assert "default group is gloo" in message, (case, message)
