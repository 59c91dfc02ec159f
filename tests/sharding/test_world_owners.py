"""Owners over the whole mesh for parameters with replicas (HSDP).

Before, each replica group planned and orthogonalized every matrix on its own: on R replicas of S
shards, R times the Newton-Schulz work of the mesh. With ``owners="mesh"`` the plan picks one owner
per matrix among all R x S ranks; the owner reads the blocks of its own replica and sends every rank
of every replica its block of the result. Checked here: the layout against DTensor's chunking, the
routes without processes up to 1,024 ranks (every block reaches its owner exactly once, every rank
gets its block of every result exactly once), the bytes against the formula of
``planning/traffic.py``, and on 4 gloo ranks (HSDP 2x2 and 3-D meshes) a step bitwise equal to one
process, each matrix orthogonalized once in the mesh, and measured bytes equal to the plan's.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from muon_dtensor import Muon
from muon_dtensor.planning.costmodel import LLAMA3_8B, Hardware, compare_owners, hsdp_plan, predict
from muon_dtensor.planning.traffic import Traffic, mean_traffic, traffic
from muon_dtensor.sharding.plan.blocks import AxisShard, Block, block_numel, full_block, mesh_blocks
from muon_dtensor.sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, build_plan
from muon_dtensor.sharding.plan.routes import build_routes
from tests.harness.ranks import run_ranks
from tests.helpers.models import distribute_like, full, stepped

TIMEOUT = 240.0  # seconds for one 4-rank call on 2 busy cores
# Uneven rows and columns, fewer rows than shards, several matrices of one shape (batched owners).
SHAPES = [(37, 24), (37, 24), (24, 37), (3, 16), (1, 8), (64, 64), (64, 64), (16, 96)]


# ------------------------------------------------------------------------- pure: layout and routes
def _shards(mesh_shape: tuple[int, ...], placements: tuple) -> list[AxisShard]:
    return [AxisShard(a, p.dim, mesh_shape[a]) for a, p in enumerate(placements) if isinstance(p, Shard)]


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [
        ((2, 2), (Replicate(), Shard(0))),
        ((2, 2), (Shard(1), Replicate())),
        ((3, 2), (Replicate(), Shard(0))),
        ((2, 1, 2), (Replicate(), Shard(1), Shard(0))),
        ((2, 2, 2), (Replicate(), Replicate(), Shard(0))),
        ((2, 3, 2), (Shard(0), Replicate(), Shard(1))),
    ],
)
def test_mesh_blocks_are_dtensors_and_each_replica_tiles_the_matrix(
    mesh_shape: tuple, placements: tuple
) -> None:
    shape = (37, 24)
    blocks, replica_of = mesh_blocks(shape, mesh_shape, _shards(mesh_shape, placements))
    for flat, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        assert tuple(len(range(*iv[0])) for iv in blocks[flat]) == tuple(local)
        if block_numel(blocks[flat]):
            assert tuple(dim[0][0] for dim in blocks[flat]) == tuple(offset)
    for replica in set(replica_of):
        covered = torch.zeros(shape, dtype=torch.int32)
        for block in (b for b, c in zip(blocks, replica_of) if c == replica):
            for (r0, r1), (c0, c1) in itertools.product(*block):
                covered[r0:r1, c0:c1] += 1
        assert torch.equal(covered, torch.ones_like(covered))
    assert len(set(replica_of)) == math.prod(
        n for n, p in zip(mesh_shape, placements) if not isinstance(p, Shard)
    )


def _mesh_entries(shapes: list[tuple[int, int]], replicas: int, shards: int) -> list[MatrixEntry]:
    out = []
    for s in shapes:
        blocks, replica_of = mesh_blocks(s, (replicas, shards), [AxisShard(1, 0, shards)])
        out.append(MatrixEntry(s, blocks, replica_of=replica_of))
    return out


def _cells(block: Block) -> list[tuple[int, int]]:
    return [(r, c) for a, b in block[0] for r in range(a, b) for c0, c1 in block[1] for c in range(c0, c1)]


def _check_owner_assembles_each_element_once(plan: Plan, owner: int, routes: Any) -> None:
    for route in routes:
        inbound = route.inbound
        for _, members in inbound.stacks:
            for m in members:
                entry = plan.entries[m]
                cells = [c for mm, b in inbound.own if mm == m for c in _cells(b)]
                cells += [c for mm, src, _, b in inbound.received if mm == m for c in _cells(b)]
                assert sorted(cells) == _cells(full_block(entry.shape)), (owner, m)
                sources = {src for mm, src, _, _ in inbound.received if mm == m}
                assert all(entry.replica_of[s] == entry.replica_of[owner] for s in sources)


def _check_routes(plan: Plan, ranks: list[int]) -> None:
    """Full checks for ``ranks`` (all ranks on small meshes): what each rank sends is what its peer
    expects, owners assemble every element once, every rank gets its block of every member once."""
    routes = {r: build_routes(plan, r) for r in ranks}
    for k, rnd in enumerate(plan.rounds):
        owners = dict(zip(rnd.members, rnd.owners))
        sends: dict[tuple[int, int], int] = {}
        for s in ranks:
            inbound = routes[s][k].inbound
            for d, members in enumerate(inbound.sends):
                for m in members:
                    assert owners[m] == d and plan.entries[m].feeds(s, d)
                    sends[(s, d)] = sends.get((s, d), 0) + block_numel(plan.entries[m].blocks[s])
        for d in ranks:
            for s, numel in enumerate(routes[d][k].inbound.recv_numels):
                assert s not in routes or numel == sends.get((s, d), 0), (s, d)
            out = routes[d][k].outbound
            got = [m for m, _, _, _ in out.received] + [m for m, _ in out.own] + [m for m, _ in out.empty]
            assert sorted(got) == sorted(rnd.members), d  # every result, exactly once
            for m, src, _, shape in out.received:
                assert owners[m] == src and math.prod(shape) == block_numel(plan.entries[m].blocks[d])
    for owner in {o for rnd in plan.rounds for o in rnd.owners} & set(ranks):
        _check_owner_assembles_each_element_once(plan, owner, routes[owner])


@pytest.mark.parametrize(("replicas", "shards"), [(2, 2), (2, 4), (4, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("max_round_bytes", [None, 3000])
def test_routes_over_the_mesh_deliver_every_block_once(
    replicas: int, shards: int, max_round_bytes: int | None
) -> None:
    shapes = [*SHAPES, (9, 5)]
    entries = _mesh_entries(shapes, replicas, shards)
    plan = build_plan(entries, replicas * shards, max_round_bytes=max_round_bytes)
    _check_routes(plan, list(range(replicas * shards)))
    owners = sorted(o for rnd in plan.rounds for o in rnd.owners)
    assert len(owners) == len(shapes)  # one owner per matrix in the mesh, not one per replica
    assert len(set(owners)) == min(len(shapes), replicas * shards) or max_round_bytes


def test_routes_of_a_1024_rank_mesh_without_a_process() -> None:
    """8 replicas of 128 shards: the owners' and a sample of other ranks' routes in full."""
    shapes = [(2048, 8), (1024, 16), (1000, 3), (7, 64)]  # small: every cell is checked
    plan = build_plan(_mesh_entries(shapes, 8, 128), 1024)
    owners = [o for rnd in plan.rounds for o in rnd.owners]
    assert len(set(owners)) == len(shapes)
    replicas = {o // 128 for o in owners}
    assert len(replicas) > 1, "owners spread over replicas, not only the first"
    _check_routes(plan, sorted({*owners, 0, 1, 127, 128, 513, 1023}))


# ------------------------------------------------------------------------- pure: bytes and cost
def _formula(plan: Plan, rank: int, itemsize: int) -> Traffic:
    """The per-rank formula of ``planning/traffic.py``, written from the owners alone."""
    sw = sa = rw = ra = 0
    owner = {m: o for rnd in plan.rounds for m, o in zip(rnd.members, rnd.owners)}
    for m, entry in enumerate(plan.entries):
        replica_of = entry.replica_of or (0,) * plan.group_size
        whole, mine = math.prod(entry.shape), block_numel(entry.blocks[rank])
        same = replica_of[owner[m]] == replica_of[rank]
        if owner[m] == rank:
            rw += whole - mine
            sw += whole - mine
            sa += (len(set(replica_of)) - 1) * whole
        elif same:
            sw += mine
            rw += mine
        else:
            ra += mine
    return Traffic(sw * itemsize, sa * itemsize, rw * itemsize, ra * itemsize)


@pytest.mark.parametrize(("replicas", "shards"), [(2, 2), (2, 4), (4, 4), (8, 8), (8, 128)])
def test_bytes_per_rank_follow_the_formula(replicas: int, shards: int) -> None:
    # rows divisible by every shard count: blocks even, so the mean formula is exact
    shapes = [(1024, 256), (256, 1024), (2048, 512)] * 5
    plan = hsdp_plan(shapes, shards, replicas)
    n = replicas * shards
    ranks = range(n) if n <= 64 else range(0, n, 37)
    for r in ranks:
        t = traffic(plan, r, 2)
        assert t == _formula(plan, r, 2), r
        assert t.sent == plan.bytes_sent(r, 2)
    total = sum(2 * a * b for a, b in shapes)
    if n <= 64:
        within, across = mean_traffic(total, replicas, shards, "mesh")
        assert sum(traffic(plan, r, 2).sent_within for r in range(n)) / n == within
        assert sum(traffic(plan, r, 2).sent_across for r in range(n)) / n == across
        assert sum(traffic(plan, r, 2).received_across for r in range(n)) / n == across
    # the cost model counts the same bytes
    assert predict(shapes, shards, replicas=replicas, owners="mesh").bytes_sent_mean == pytest.approx(
        sum(mean_traffic(total, replicas, shards, "mesh")), rel=1e-12
    )


def test_routes_send_what_the_plan_counts() -> None:
    plan = build_plan(_mesh_entries(SHAPES, 2, 2), 4, max_round_bytes=3000)
    for r in range(4):
        routes = build_routes(plan, r)
        inbound = sum(
            block_numel(plan.entries[m].blocks[r]) for rt in routes for ms in rt.inbound.sends for m in ms
        )
        back = sum(block_numel(b) for rt in routes for per in rt.outbound.sends for _, b in per)
        assert 2 * (inbound + back) == plan.bytes_sent(r, 2) == traffic(plan, r, 2).sent


def test_cost_model_picks_mesh_owners_for_llama_and_replicas_for_slow_links() -> None:
    mesh = predict(LLAMA3_8B, 8, replicas=8, owners="mesh")
    replica = predict(LLAMA3_8B, 8, replicas=8, owners="replica")
    assert mesh.total < replica.total and predict(LLAMA3_8B, 8, replicas=8, owners="auto") == mesh
    assert replica.total == predict(LLAMA3_8B, 8).total  # each replica runs one shard group's step
    assert mesh.newton_schulz == pytest.approx(predict(LLAMA3_8B, 64).newton_schulz)
    # enough Newton-Schulz that doing it once per mesh shows, and a link across nodes at 1 MB/s
    shapes = [(1024, 1024)] * 8
    slow = Hardware.h200(inter_node_bandwidth=1e6, gpus_per_node=2)
    entries = _mesh_entries(shapes, 2, 2)
    times = compare_owners(entries, [0, 0, 1, 1], slow)
    assert times["replica"] < times["mesh"]
    assert predict(shapes, 2, slow, replicas=2, owners="auto").owners == "replica"
    assert compare_owners(entries, [0, 0, 0, 0], slow)["mesh"] < times["replica"]  # one node: mesh


def test_owners_option_is_checked() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"owners should be 'auto', 'mesh' or 'replica' but is: 'world'"):
        Muon([p], owners="world")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owners should be"):
        Muon([{"params": [p], "owners": None}])


# ------------------------------------------------------------------------- 4 gloo ranks
# name -> (mesh shape, placements per parameter; cycled over SHAPES)
LAYOUTS: dict[str, tuple[tuple[int, ...], list[tuple]]] = {
    "hsdp": ((2, 2), [(Replicate(), Shard(0))]),
    "hsdp_dim1_inner_replicas": ((2, 2), [(Shard(1), Replicate())]),
    "3d_2x2x1": ((2, 2, 1), [(Replicate(), Shard(0), Shard(1))]),
    "3d_2x1x2": ((2, 1, 2), [(Replicate(), Shard(1), Shard(0))]),
    "3d_4_replicas_of_1": ((2, 2, 1), [(Replicate(), Replicate(), Shard(0))]),
    # one exchange group, three kinds of entries: with replicas, replicated, sharded on both axes
    "mixed": ((2, 2), [(Replicate(), Shard(0)), (Replicate(), Replicate()), (Shard(0), Shard(1))]),
}
OWNERS = ("mesh", "replica")
AUTO = ("hsdp", "3d_4_replicas_of_1")  # layouts also stepped with owners="auto"
STEPS = 2


def _run(
    mesh_shape: tuple[int, ...] | None, placements: list[tuple], **kwargs: Any
) -> tuple[list, list, Muon]:
    """Parameters and momenta after ``STEPS`` steps with the same full gradients, sharded (placements
    cycled over the parameters) or in one process (mesh_shape None)."""
    params, opt = stepped(
        SHAPES,
        mesh_shape,
        lambda i: placements[i % len(placements)],
        STEPS,
        lambda ps: Muon([{"params": ps, **kwargs}], lr=0.02),
    )
    return params, [opt.state[p]["momentum_buffer"] for p in params], opt


def _differ(tensors: list, refs: list) -> list[int]:
    """Indices whose full tensor differs from the reference in any bit (a collective per DTensor)."""
    return [i for i, (t, r) in enumerate(zip(tensors, refs)) if not torch.equal(full(t), r)]


def _replica_of_peers(mesh_shape: tuple[int, ...], placements: tuple) -> list[int]:
    return list(mesh_blocks((8, 8), mesh_shape, _shards(mesh_shape, placements))[1])


def world_owner_steps() -> dict[str, Any]:
    """Rank function: per layout and owners option, parameters and momenta that differ from one
    process, matrices this rank orthogonalized, and bytes sent within / across replicas."""
    ref_params, ref_bufs, _ = _run(None, [])
    out: dict[str, Any] = {}
    for name, (mesh_shape, placements) in LAYOUTS.items():
        replica_of = _replica_of_peers(mesh_shape, placements[0])
        for owners in OWNERS + (("auto", "gather") if name in AUTO else ()):
            # "gather": mode="gather" (every rank computes every matrix) on the mesh-wide layout
            kwargs = {"owners": "mesh", "mode": "gather"} if owners == "gather" else {"owners": owners}
            params, bufs, opt = _run(mesh_shape, placements, **kwargs)
            stats = opt.comm_stats
            me = replica_of[dist.get_rank()]
            out[f"{name}/{owners}"] = {
                "params": _differ(params, ref_params),
                "momentum": _differ(bufs, ref_bufs),
                "orthogonalized": stats.orthogonalized // STEPS,
                "sent": stats.sent // STEPS,
                "within": sum(v for d, v in stats.sent_to.items() if replica_of[d] == me) // STEPS,
                "across": sum(v for d, v in stats.sent_to.items() if replica_of[d] != me) // STEPS,
                "mesh": bool(opt._plans.entries[0].sharding.across),
            }
    return out


def _expected_traffic(mesh_shape: tuple[int, ...], placements: tuple) -> list[Traffic]:
    """The plan the optimizer builds for LAYOUTS' one-placement layouts, priced per rank."""
    entries = []
    for s in SHAPES:
        blocks, replica_of = mesh_blocks(s, mesh_shape, _shards(mesh_shape, placements))
        whole = all(b == full_block(s) for b in blocks)
        entries.append(MatrixEntry(s, blocks, replicated=whole, replica_of=replica_of))
    plan = build_plan(entries, math.prod(mesh_shape), max_round_bytes=DEFAULT_ROUND_BYTES)
    return [traffic(plan, r, 2) for r in range(plan.group_size)]


@pytest.mark.slow
def test_four_ranks_step_exactly_once_per_matrix_over_the_mesh() -> None:
    results = run_ranks(world_owner_steps, 4, timeout=TIMEOUT)
    matrices = len(SHAPES)
    for key in results[0]:
        name, owners = key.split("/")
        mesh_shape, placements = LAYOUTS[name]
        for rank, per_key in enumerate(results):
            r = per_key[key]
            assert r["params"] == [] and r["momentum"] == [], (rank, key, r)
        done = sum(per_key[key]["orthogonalized"] for per_key in results)
        mesh = results[0][key]["mesh"]
        assert all(per_key[key]["mesh"] == mesh for per_key in results)
        assert mesh == (owners != "replica"), key  # auto picks the mesh on one CPU node
        if name == "mixed":
            continue  # several layouts per group: counted by the layouts above
        replicas = len(set(_replica_of_peers(mesh_shape, placements[0])))
        if owners == "gather":
            assert done == 4 * matrices and all(per_key[key]["across"] == 0 for per_key in results), key
            continue
        assert done == (matrices if mesh else replicas * matrices), (key, done)
        expected = _expected_traffic(mesh_shape, placements[0]) if mesh else [Traffic()] * 4
        for rank, per_key in enumerate(results):
            got, want = per_key[key], expected[rank]
            assert got["across"] == want.sent_across, (key, rank)
            assert not mesh or (got["sent"], got["within"]) == (want.sent, want.sent_within), (key, rank)


def disagreeing_owners() -> str:
    mesh = init_device_mesh("cpu", (2, 2))
    p = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, (Replicate(), Shard(0))))
    opt = Muon([("w", p)], owners="mesh" if dist.get_rank() == 0 else "replica")
    p.grad = distribute_tensor(torch.randn(8, 8), mesh, (Replicate(), Shard(0)))
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_owners_all_raise_naming_it() -> None:
    messages = run_ranks(disagreeing_owners, 4, timeout=TIMEOUT)
    assert all(m.startswith("ranks disagree about the optimizer") for m in messages), messages
    # rank 3 shares no mesh axis with rank 0, so it sees the disagreement but not rank 0's value
    for message in messages[:3]:
        assert "param group 0 'owners': 'mesh' vs 'replica'" in message, message


def test_plan_command_prices_hsdp_with_the_optimizers_default_owners(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from muon_dtensor.tools.plan_command import main

    assert main(["--model", "llama3-8b", "--shard", "8", "--replicate", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["prediction"]
    assert got == dataclasses.asdict(predict(LLAMA3_8B, 8, replicas=8, owners="auto"))
    assert got["owners"] == "mesh" and got["replicas"] == 8
    assert main(["--model", "llama3-8b", "--shard", "8", "--replicate", "8"]) == 0
    assert "owners among all GPUs" in capsys.readouterr().out


def split_vote() -> tuple[bool, int]:
    """Rank function: rank 0 alone finds owners over the mesh cheaper (the cost model's verdict
    patched, and restored: the pool's processes live on); every rank must take the same layout."""
    from muon_dtensor.optim import policy

    verdict = policy._mesh_pays
    policy._mesh_pays = lambda *args: dist.get_rank() == 0
    try:
        _, _, opt = _run((2, 2), [(Replicate(), Shard(0))], owners="auto")
    finally:
        policy._mesh_pays = verdict
    return bool(opt._plans.entries[0].sharding.across), opt.comm_stats.orthogonalized


def test_auto_takes_the_mesh_only_if_every_rank_votes_for_it() -> None:
    results = run_ranks(split_vote, 4, timeout=TIMEOUT)
    assert [mesh for mesh, _ in results] == [False] * 4
    assert sum(done for _, done in results) == 2 * len(SHAPES) * STEPS  # each replica did every matrix


def stage_meshes_auto() -> tuple[bool, int]:
    """Rank function: two pipeline stages, each an HSDP mesh of 2 of the 4 ranks. Where owners over
    the mesh pay (the verdict patched), "auto" takes them on each stage's mesh: its exchange group is
    created by that stage's ranks alone, so a group every rank creates afterwards still forms."""
    from muon_dtensor.optim import policy

    world = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))
    stage = world["rep", "shard"]
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), stage, [Replicate(), Shard(0)]))
              for s in SHAPES]  # fmt: skip
    verdict = policy._mesh_pays
    policy._mesh_pays = lambda *args: True
    try:
        opt = Muon([{"params": params, "owners": "auto"}], lr=0.02)
        for p in params:
            p.grad = distribute_like(p, torch.randn(p.shape, generator=gen))
        opt.step()
    finally:
        policy._mesh_pays = verdict
    everyone = torch.ones(1)
    dist.all_reduce(everyone, group=dist.new_group(list(range(dist.get_world_size()))))
    assert int(everyone) == dist.get_world_size()
    return bool(opt._plans.entries[0].sharding.across), opt.comm_stats.orthogonalized


def test_auto_takes_owners_over_a_stage_mesh_of_some_ranks() -> None:
    results = run_ranks(stage_meshes_auto, 4, timeout=TIMEOUT)
    assert [mesh for mesh, _ in results] == [True] * 4
    assert sum(done for _, done in results) == 2 * len(SHAPES)  # each stage's matrices once
