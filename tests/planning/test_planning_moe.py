"""Mixture-of-experts models in ``plan``: the DeepSeek-V3 and Kimi K2 presets, expert parallelism
(``--ep``: experts Shard(0) over ep, Shard(1) over the ranks of each ep group, as torchtitan lays them
out) priced as the dense group and the expert groups one after the other, per-rank memory, and the
command's report and JSON. Pure arithmetic: no process."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from muon_dtensor.planning.costmodel import CURRENT, Hardware, predict
from muon_dtensor.planning.experts import ExpertLayout, expert_owned, moe_memory, moe_predict
from muon_dtensor.planning.shapes import DEEPSEEK_V3, KIMI_K2, MoEModel
from muon_dtensor.planning.traffic import mean_traffic
from muon_dtensor.sharding.plan.blocks import AxisShard, shard_blocks
from muon_dtensor.sharding.plan.build import MatrixEntry, build_plan
from muon_dtensor.sharding.plan.views import matrix_views
from muon_dtensor.tools.plan_command import main, parse_args

# 4 experts of 3 gated stacks in 2 MoE layers beside one dense matrix: plans in milliseconds.
TINY = MoEModel("tiny", ((8, 8),), 4, ((12, 8), (8, 12), (12, 8)), 2)
STACK = 2048 * 7168  # one expert matrix of DeepSeek-V3 / Kimi K2


def test_deepseek_v3_preset_counts_and_shapes() -> None:
    m = DEEPSEEK_V3
    assert (m.experts, m.moe_layers, m.stacks) == (256, 58, ((2048, 7168), (2048, 7168), (7168, 2048)))
    # 3 dense layers: MLA (5) + gated MLP (3); 58 MoE layers: MLA + router + shared expert (3)
    assert len(m.dense) == 3 * 8 + 58 * 9 == 546 and m.expert_matrices == 256 * 3 * 58 == 44544
    mla = [(1536, 7168), (128 * 192, 1536), (512 + 64, 7168), (128 * 256, 512), (7168, 128 * 128)]
    assert list(m.dense[:8]) == mla + [(18432, 7168), (18432, 7168), (7168, 18432)]
    assert list(m.dense[24:33]) == mla + [(256, 7168), (2048, 7168), (2048, 7168), (7168, 2048)]
    assert len(m.expert_shapes(2)) == 2 * 3 * 58 and m.expert_shapes(1)[:3] == list(m.stacks)
    # DeepSeek-V3's 671B parameters = these matrices + input and output embeddings (129,280 x 7168 each)
    total = sum(r * c for r, c in m.dense) + m.expert_elements() + 2 * 129280 * 7168
    assert total == pytest.approx(671e9, rel=2e-3)


def test_kimi_k2_is_deepseek_v3_with_384_experts_64_heads_one_dense_layer() -> None:
    k = KIMI_K2
    assert (k.experts, k.moe_layers, k.stacks) == (384, 60, DEEPSEEK_V3.stacks)
    assert len(k.dense) == 8 + 60 * 9 and k.expert_matrices == 384 * 3 * 60
    assert k.dense[1] == (64 * 192, 1536) and k.dense[4] == (7168, 64 * 128) and k.dense[13] == (384, 7168)


@pytest.mark.parametrize("ep", [None, 64])
def test_whole_experts_move_nothing(ep: int | None) -> None:
    """Without ep (Shard(0) over experts on 64 ranks) and with ep = 64, every expert sits whole on
    one rank: the step's bytes are the dense group's alone, and each rank orthogonalizes 4 x 3 x 58."""
    parts = moe_predict(DEEPSEEK_V3, ExpertLayout(64, ep))
    dense = predict(list(DEEPSEEK_V3.dense), 64)
    assert parts.dense == dense
    assert parts.experts.bytes_sent_max == parts.experts.comm == parts.experts.collectives == 0
    assert parts.step.bytes_sent_mean == dense.bytes_sent_mean and parts.step.world_size == 64
    assert expert_owned(DEEPSEEK_V3, ExpertLayout(64, ep), 4 << 20) == [4 * 3 * 58] * 64


def test_ep_by_fsdp_is_the_dense_group_then_one_fsdp_group() -> None:
    """ep 8 on 64 GPUs: 32 experts per ep rank, rows over 8 ranks ep apart (one per node). The step
    is the dense group on 64 ranks plus one 8-rank group of 32 x 3 x 58 experts (all 8 at once),
    whose mean bytes are traffic.py's 2 M (F - 1) / F^2 for its M bytes. The optimizer plans the
    experts' whole mesh, so the check sums over all 64 ranks and the 8 groups share a round's bytes
    (each its eighth)."""
    parts = moe_predict(DEEPSEEK_V3, ExpertLayout(64, 8))
    one_per_node = Hardware.h200(gpus_per_node=1)
    impl = replace(CURRENT, max_round_bytes=CURRENT.max_round_bytes // 8)  # type: ignore[operator]
    group = predict(DEEPSEEK_V3.expert_shapes(32), 8, one_per_node, impl=impl, check_ranks=64)
    assert parts.experts == group
    assert parts.step.total == pytest.approx(parts.dense.total + group.total)
    assert parts.step.comm == pytest.approx(parts.dense.comm + group.comm)
    assert parts.step.collectives == parts.dense.collectives + group.collectives
    group_bytes = 32 * 3 * 58 * STACK * 2
    assert group.bytes_sent_mean == pytest.approx(mean_traffic(group_bytes, 1, 8, "replica")[0])
    assert group.bytes_sent_mean > 30 * parts.dense.bytes_sent_mean  # the experts dominate
    owned = expert_owned(DEEPSEEK_V3, ExpertLayout(64, 8), 4 << 20)
    assert sum(owned) == DEEPSEEK_V3.expert_matrices and min(owned) == max(owned) == 32 * 3 * 58 // 8
    # ep 16: 4 ranks per group, 16 apart (each on its own node)
    assert moe_predict(DEEPSEEK_V3, ExpertLayout(64, 16)).experts.bytes_sent_mean == pytest.approx(
        mean_traffic(16 * 3 * 58 * STACK * 2, 1, 4, "replica")[0]
    )


def test_optimizer_plan_moves_the_modelled_bytes() -> None:
    """The optimizer plans a stack over the whole (fsdp, ep) mesh, with each expert's owner among its
    F ranks (``MatrixEntry.sharers``): its bytes are the in-group pricing's, its owners balanced.
    Before owners were kept there, an owner outside moved F / (F - 1) times as much (x 1.17 here)."""
    ep, f = 2, 4
    entries = []
    for _ in range(TINY.moe_layers):
        for rows, cols in TINY.stacks:
            shape = (TINY.experts, rows, cols)
            blocks = shard_blocks(shape, [AxisShard(0, 1, f), AxisShard(1, 0, ep)])  # rank = f_i * ep + c
            entries += [
                MatrixEntry(v.shape, v.blocks) for v in matrix_views(shape, blocks, 0, name="w", experts=True)
            ]
    plan = build_plan(entries, ep * f)
    actual = sum(plan.bytes_sent(r, 2) for r in range(ep * f)) / (ep * f)
    modelled = moe_predict(TINY, ExpertLayout(ep * f, ep)).experts.bytes_sent_mean
    assert actual == modelled > 0 and plan.imbalance == 1.0


def test_redundant_and_gather_count_every_expert() -> None:
    everything = list(TINY.dense) + TINY.expert_shapes(TINY.experts)
    redundant = moe_predict(TINY, ExpertLayout(8, 2), mode="redundant").step
    assert redundant.total == pytest.approx(predict(everything, 1, mode="redundant").total)
    owner = moe_predict(TINY, ExpertLayout(8, 2)).step
    gather = moe_predict(TINY, ExpertLayout(8, 2), mode="gather").step
    assert gather.newton_schulz > owner.newton_schulz and gather.imbalance == pytest.approx(1.0)


def test_memory_per_rank() -> None:
    """fp32 momentum of the blocks each rank holds: the dense matrix's row (8 elements), plus without
    ep one whole expert per stack and layer on ranks 0-3 and none on 4-7; with ep 2 (4 ranks per
    group), a quarter of the rows of 2 experts per stack and layer on every rank."""
    expert = sum(r * c for r, c in TINY.stacks) * TINY.moe_layers  # one expert of every stack and layer
    flat = moe_memory(TINY, ExpertLayout(8), None)
    assert flat["momentum"] == [4 * (8 + expert)] * 4 + [4 * 8] * 4
    assert flat["peak_transient"][0] > flat["peak_transient"][7] > 0
    ep = moe_memory(TINY, ExpertLayout(8, 2), None)
    assert ep["momentum"] == [4 * (8 + 2 * expert // 4)] * 8
    assert sum(ep["momentum"]) == sum(flat["momentum"]) == 4 * (64 + TINY.expert_elements())
    big = moe_memory(DEEPSEEK_V3, ExpertLayout(64, 8), 4 << 20)["momentum"]
    elements = sum(r * c for r, c in DEEPSEEK_V3.dense) + DEEPSEEK_V3.expert_elements()
    assert min(big) == max(big) == 4 * elements // 64


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_prices_the_preset_with_and_without_ep(capsys: pytest.CaptureFixture[str]) -> None:
    got = _json(capsys, "--model", "deepseek-v3", "--gpus", "64", "--ep", "8")
    parts = moe_predict(DEEPSEEK_V3, ExpertLayout(64, 8))
    assert got["prediction"] == asdict(parts.step)
    assert got["experts"]["dense"] == asdict(parts.dense) and got["experts"]["experts"] == asdict(
        parts.experts
    )
    assert (got["experts"]["ep"], got["experts"]["fsdp_in_ep"]) == (8, 8)
    assert got["experts"]["owned_per_rank"] == {"min": 696, "max": 696, "sum": 44544}
    momentum = moe_memory(DEEPSEEK_V3, ExpertLayout(64, 8), 4 << 20)["momentum"]
    assert got["memory"]["momentum"] == {"min": min(momentum), "max": max(momentum)}
    flat = _json(capsys, "--model", "deepseek-v3", "--gpus", "64")
    assert flat["experts"]["ep"] is None and flat["experts"]["experts"]["bytes_sent_mean"] == 0
    assert flat["prediction"]["bytes_sent_mean"] < got["prediction"]["bytes_sent_mean"]


def test_cli_report_names_the_expert_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "kimi-k2", "--gpus", "64", "--ep", "16"]) == 0
    out = capsys.readouterr().out
    p = moe_predict(KIMI_K2, ExpertLayout(64, 16)).step
    assert f"| step | {round(p.total * 1e3, 1)} |" in out
    assert "kimi-k2 (548 dense, 69,120 experts)" in out
    assert "ep 16 x fsdp-in-ep 4: Shard(0) over ep, 24 experts per ep rank" in out
    assert re.search(r"each expert once in the world \(69,120\), 1,080-1,080 per rank", out), out
    assert "experts.moe_predict: dense, then experts" in out
    assert parse_args(["--model", "kimi-k2", "--gpus", "8"]).shapes[548:551] == [(2048, 7168)] * 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "deepseek-v3", "--gpus", "64", "--ep", "3"], "--ep 3 does not divide --gpus 64"),
        (
            ["--model", "deepseek-v3", "--gpus", "96", "--ep", "24"],
            "--ep 24 does not divide deepseek-v3's 256",
        ),
        (["--model", "kimi-k2", "--gpus", "512", "--ep", "256"], "--ep 256 does not divide kimi-k2's 384"),
        (["--model", "llama3-8b", "--gpus", "64", "--ep", "8"], "--ep 8: llama3-8b has no expert stacks"),
        (
            ["--layers", "2", "--dim", "64", "--gpus", "8", "--ep", "2"],
            "--ep 2: a custom model has no expert",
        ),
        (
            ["--model", "deepseek-v3", "--shard", "64", "--replicate", "2", "--ep", "8"],
            "--ep 8 with --replicate 2",
        ),
        (["--model", "deepseek-v3", "--gpus", "64", "--ep", "0"], "argument --ep: 0 is below 1"),
    ],
)
def test_bad_ep_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "give" in err or "plan one replica group" in err or "below" in err or "MoE preset" in err


def test_fsdp_groups_ep_apart_use_node_links() -> None:
    """With 16 GPUs per node, ep 4 leaves 4 ranks of each 4-rank group on one node: all its traffic
    stays in the node, so the expert exchange is faster than with 8 GPUs per node (2 per node)."""
    wide = replace(Hardware.h200(), gpus_per_node=16)
    fast = moe_predict(DEEPSEEK_V3, ExpertLayout(16, 4), wide).experts
    slow = moe_predict(DEEPSEEK_V3, ExpertLayout(16, 4)).experts
    assert fast.bytes_sent_mean == slow.bytes_sent_mean and fast.comm < slow.comm
    assert math.isclose(fast.newton_schulz, slow.newton_schulz)


def test_benchmarks_md_quotes_what_plan_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/benchmarks.md's MoE rows on 64 GPUs are the command's JSON, rounded as printed there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    rows = re.findall(r"^\| (deepseek-v3) \| (64) \| (\S+) \| \S+ \| (.+) \|$", text, re.M)
    assert len(rows) == 3
    for model, gpus, ep, rest in rows:
        got = _json(capsys, "--model", model, "--gpus", gpus, *(["--ep", ep] if ep != "-" else []))
        p, e, m = got["prediction"], got["experts"], got["memory"]
        want = [
            f"{p['total'] * 1e3:.1f}", f"{p['newton_schulz'] * 1e3:.1f}", f"{p['comm'] * 1e3:.1f}",
            f"{e['dense']['bytes_sent_mean'] / 1e6:,.1f}", f"{e['experts']['bytes_sent_mean'] / 1e6:,.1f}",
            f"{p['bytes_sent_mean'] / 1e6:,.1f}", f"{p['imbalance']:.3f}",
            f"{m['momentum']['max'] / 2**30:.1f}", f"{m['peak_transient']['max'] / 2**30:.1f}",
        ]  # fmt: skip
        assert rest.split(" | ") == want, (ep, rest)
