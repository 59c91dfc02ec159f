"""The cost model (muon_dtensor/planning/costmodel.py) is pure arithmetic over the plan: checked here
against the traffic formulas (owner 2 S (N-1) / N^2, gather S (N-1) / N per rank, S the bytes of all
matrices), the plan's own byte counts, and the properties any step-time model must have. One test runs
benchmarks/gpu_ns.py with no GPU visible."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from muon_dtensor.numerics.newton_schulz import ns_flops
from muon_dtensor.planning.costmodel import (
    CURRENT,
    FUSED,
    LLAMA3_8B,
    Hardware,
    fit_latency_bandwidth,
    predict,
    sharded_plan,
    transformer_shapes,
)
from muon_dtensor.planning.links import pipeline_seconds
from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
UNIFORM = [(512, 256)] * 64  # 64 equal matrices: every rank owns the same number at N | 64


def test_llama3_8b_shapes_and_flops_match_the_reference() -> None:
    # 5 iterations of 4 m^2 n + 2 m^3 flops on Llama-3-8B's 224 hidden matrices: ~666 TFLOP.
    assert len(LLAMA3_8B) == 224
    total = sum(ns_flops(s, 5) for s in LLAMA3_8B)
    assert total == pytest.approx(666e12, rel=0.001)


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_owner_traffic_is_2S_N_minus_1_over_N_squared(n: int) -> None:
    s = sum(r * c for r, c in UNIFORM) * 2
    p = predict(UNIFORM, n)
    assert p.bytes_sent_mean == pytest.approx(2 * s * (n - 1) / n**2, rel=1e-12)
    assert p.bytes_sent_max == pytest.approx(p.bytes_sent_mean, rel=1e-12)
    g = predict(UNIFORM, n, mode="gather")
    assert g.bytes_sent_mean == pytest.approx(s * (n - 1) / n, rel=1e-12)


@pytest.mark.parametrize("n", [8, 64])
@pytest.mark.parametrize("mode", ["owner", "gather"])
def test_per_collective_traffic_adds_up_to_plan_bytes_sent(n: int, mode: str) -> None:
    """The model splits traffic by collective and link; its per-rank sum must be the plan's count."""
    shapes = LLAMA3_8B[:14]
    plan = sharded_plan(shapes, n, mode)
    expected = [plan.bytes_sent(r, 2) for r in range(n)]
    p = predict(shapes, n, mode=mode)
    assert p.bytes_sent_max == max(expected)
    assert p.bytes_sent_mean == pytest.approx(sum(expected) / n, rel=1e-12)


def test_owner_step_is_monotonic_in_world_size() -> None:
    totals = [predict(LLAMA3_8B, n).total for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(b < a for a, b in pairwise(totals)), totals
    compute = [predict(LLAMA3_8B, n).newton_schulz for n in (8, 16, 32, 64)]
    assert all(b < a for a, b in pairwise(compute)), compute


def test_redundant_newton_schulz_does_not_depend_on_world_size() -> None:
    times = {predict(LLAMA3_8B, n, mode="redundant").total for n in (1, 8, 64, 1024)}
    assert len(times) == 1
    # Five iterations on every hidden matrix of Llama-3-8B: ~666 TFLOP at the default 790 TFLOP/s is ~843 ms.
    assert times.pop() == pytest.approx(0.843, rel=0.01)


def test_llama3_8b_predictions_are_finite_and_ordered() -> None:
    owner8, owner64 = predict(LLAMA3_8B, 8), predict(LLAMA3_8B, 64)
    redundant = predict(LLAMA3_8B, 8, mode="redundant")
    for p in (owner8, owner64, redundant):
        assert math.isfinite(p.total) and p.total > 0
    assert owner64.total < owner8.total < redundant.total
    # Owner mode at 8 ranks cannot beat a perfect 1/8 of the Newton-Schulz work.
    assert owner8.total >= redundant.total / 8
    assert predict(LLAMA3_8B, 8, impl=FUSED).total < owner8.total


def test_links_cross_nodes_only_beyond_a_node() -> None:
    hw = Hardware.h200()
    one_node = predict(UNIFORM, 8, hw)
    slow_ib = predict(UNIFORM, 8, replace(hw, inter_node_bandwidth=1.0))
    assert slow_ib.comm == one_node.comm  # 8 ranks on one 8-GPU node never touch InfiniBand
    two_nodes = predict(UNIFORM, 16, hw)
    assert (
        predict(UNIFORM, 16, replace(hw, inter_node_bandwidth=hw.inter_node_bandwidth / 2)).comm
        > two_nodes.comm
    )


def test_host_overhead_hides_on_an_async_device_and_adds_on_a_cpu() -> None:
    hw = Hardware.h200(op_overhead=0.0)
    base = predict(LLAMA3_8B, 8, hw).total
    small = predict(LLAMA3_8B, 8, replace(hw, op_overhead=1e-6)).total
    assert small == pytest.approx(base, rel=1e-9)  # 1 us per op hides behind the device work
    sync = predict(LLAMA3_8B, 8, replace(hw, op_overhead=1e-6, async_host=False))
    assert sync.total == pytest.approx(base + sync.host, rel=1e-9)


def test_from_measurements_recovers_rates_latency_and_bandwidth() -> None:
    link = [(b, 20e-6 + b / 3e9) for b in (1e5, 1e6, 1e7)]
    latency, bandwidth = fit_latency_bandwidth(link)
    assert latency == pytest.approx(20e-6, rel=1e-6) and bandwidth == pytest.approx(3e9, rel=1e-9)
    hw = Hardware.from_measurements(
        matmul=[(2e9, 0.01), (6e9, 0.03)], memory=[(1e9, 0.1)], link=link, gpus_per_node=2
    )
    assert hw.matmul_flops == pytest.approx(2e11) and hw.memory_bandwidth == pytest.approx(1e10)
    assert hw.collective_latency == pytest.approx(20e-6, rel=1e-6)
    assert not hw.async_host
    with pytest.raises(ValueError, match="positive"):
        Hardware.from_measurements(matmul=[(0.0, 1.0)], memory=[(1.0, 1.0)], link=link, gpus_per_node=1)


def test_transformer_shapes_spell_each_layer() -> None:
    assert transformer_shapes(1, 8) == [(8, 8)] * 4 + [(32, 8), (8, 32)]
    assert transformer_shapes(1, 8, kv_rows=2, ffn=20, gated=True) == [
        (8, 8), (2, 8), (2, 8), (8, 8), (20, 8), (20, 8), (8, 20)
    ]  # fmt: skip
    assert transformer_shapes(2, 8, fused_qkv=True)[:2] == [(24, 8), (8, 8)]
    assert CURRENT.pre_bytes + CURRENT.post_bytes == 88.0  # the count in Implementation's docstring


gpu_ns_without_cuda = background.command(
    "gpu_ns_without_cuda", [sys.executable, str(ROOT / "benchmarks" / "gpu_ns.py")],
    env=background.environ(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT)), timeout=120, cwd=ROOT,
)  # fmt: skip


@pytest.mark.slow
def test_gpu_script_exits_2_with_a_message_without_cuda(
    gpu_ns_without_cuda: subprocess.CompletedProcess,
) -> None:
    proc = gpu_ns_without_cuda
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr


def test_pipeline_follows_run_plans_issue_order() -> None:
    """One round runs in, compute, out back to back; with several, the exchange hides behind compute
    except the first round in and the last round out, and a slow link shows through."""
    assert pipeline_seconds([5.0], [1.0], [2.0]) == pytest.approx(8.0)
    assert pipeline_seconds([5.0] * 4, [1.0] * 4, [1.0] * 4) == pytest.approx(1.0 + 20.0 + 1.0)
    # Links slower than compute: the collective stream (in 0, in 1, out 0, in 2, ...) sets the pace.
    assert pipeline_seconds([1.0] * 4, [5.0] * 4, [5.0] * 4) == pytest.approx(
        40.0
    )  # 8 collectives back to back
    # Gather mode: nothing travels back.
    assert pipeline_seconds([2.0, 2.0], [1.0, 1.0], [0.0, 0.0]) == pytest.approx(5.0)


def test_pipelined_rounds_beat_one_round_for_llama3_8b() -> None:
    one_round = replace(CURRENT, max_round_bytes=None)
    for n in (8, 64):
        pipelined, single = predict(LLAMA3_8B, n), predict(LLAMA3_8B, n, impl=one_round)
        assert pipelined.total < single.total
        assert pipelined.bytes_sent_mean == pytest.approx(single.bytes_sent_mean, rel=1e-12)


def test_predictions_are_cached_and_equal_the_arithmetic() -> None:
    """``predict`` computes each setting once (the tests, the docs and the planning CLI ask for the
    same 1,024-rank predictions, seconds each): a repeat is the same frozen object, equal to the
    uncached arithmetic; with one replica group every ``owners`` is the same entry, and any other
    argument that changes is a new one. Unhashable arguments are computed, not refused."""
    from muon_dtensor.planning.costmodel import _predict

    shapes = transformer_shapes(2, 256)
    first = predict(shapes, 16, split=True)
    assert predict(list(shapes), 16, split=True) is first
    args = (tuple(shapes), 16, Hardware.h200(), "owner", CURRENT, 5, 2, "standard", 1, "replica", True, 16)
    assert _predict(*args) == first
    assert predict(shapes, 16, owners="auto", split=True) is first
    assert predict(shapes, 16, owners="mesh", replicas=2, split=True) != first
    assert predict(shapes, 16, split=False) is not first and predict(shapes, 8, split=True) != first
    as_json = [[256, 256]] * 4 + [[1024, 256]]  # shapes as JSON gives them back: lists
    assert predict(as_json, 16) == predict([(256, 256)] * 4 + [(1024, 256)], 16)  # type: ignore[arg-type]
    redundant = predict(shapes, 16, mode="redundant", owners="auto")
    assert redundant.owners == "auto" and predict(shapes, 16, mode="redundant").owners == "replica"

    class Unhashable(Hardware):
        __hash__ = None  # type: ignore[assignment]

    hw = Unhashable(**vars(Hardware.h200()))
    assert predict(shapes, 16, hw, split=True) == first


@pytest.mark.parametrize(("shards", "replicas", "per_node"), [(8, 8, 8), (16, 4, 8), (4, 2, 2)])
def test_the_optimizers_owner_prices_are_the_models(shards: int, replicas: int, per_node: int) -> None:
    """``compare_owners`` (what ``Muon(owners="auto")`` votes with) prices HSDP's two owner choices
    exactly as ``predict`` does for FSDP2's layout, the check summed over every rank of the mesh:
    the run and the rehearsal's model then take the same owners (it took mesh against the model's
    replica when the check was priced over the replica alone and the node sizes differed)."""
    from muon_dtensor.planning.costmodel import compare_owners, hsdp_plan

    hw = Hardware.h200(gpus_per_node=per_node, check_backend="gloo")
    shapes = LLAMA3_8B[:28]
    entries = hsdp_plan(shapes, shards, replicas).entries
    times = compare_owners(entries, [r // per_node for r in range(shards * replicas)], hw)
    for owners in ("mesh", "replica"):
        assert times[owners] == predict(shapes, shards, hw, replicas=replicas, owners=owners).total
    chosen = min(times, key=lambda o: (times[o], o == "mesh"))
    assert predict(shapes, shards, hw, replicas=replicas, owners="auto").owners == chosen


@pytest.mark.parametrize("replicas", [1, 4])
def test_links_of_each_round_add_up_to_traffic_per_rank(replicas: int) -> None:
    """The links of both all-to-alls, summed per layout and replica (not per matrix, which made an
    8,192-rank HSDP price take seconds), send and receive on each rank what ``traffic`` counts."""
    from muon_dtensor.planning.costmodel import hsdp_plan
    from muon_dtensor.planning.links import back_links, to_owner_links
    from muon_dtensor.planning.traffic import traffic

    plan = hsdp_plan(LLAMA3_8B[:70], 8, replicas, max_round_bytes=1 << 24)
    nodes = [r // 4 for r in range(plan.group_size)]
    sent, received = [0.0] * plan.group_size, [0.0] * plan.group_size
    for rnd in plan.rounds:
        for links in (to_owner_links(plan, rnd.members, rnd.owners, 2, nodes),
                      back_links(plan, rnd.members, rnd.owners, 2, nodes)):  # fmt: skip
            for r in range(plan.group_size):
                sent[r] += links.sent(r)
                received[r] += links.recv_intra[r] + links.recv_inter[r]
    assert len(plan.rounds) > 1
    for r in range(plan.group_size):
        counted = traffic(plan, r, 2)
        assert (sent[r], received[r]) == (counted.sent, counted.received), r
