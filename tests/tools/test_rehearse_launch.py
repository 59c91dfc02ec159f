"""``plan --rehearse`` as a launch tool (issue 48 item 4, issue 49 item 5): MoE configs through
``"experts": True`` and ``--ep``; ``--busiest`` from the plans; the one modelled step ``--check``
prints too; every bad argument an ``error:`` line and exit 2; a set-up bound that refuses huge layer
and rank counts before any work. Small worlds of a 2-layer model: each rehearsal takes a fraction of
a second."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from muon_dtensor.__main__ import main as cli
from muon_dtensor.planning.costmodel import Hardware
from muon_dtensor.tools.busiest import busiest
from muon_dtensor.tools.configs import meta_model
from muon_dtensor.tools.launch_check import lay_out
from muon_dtensor.tools.rehearse_report import MAX_SETUP_S, modelled_setup_s

TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
MOE = TINY | {"intermediate_size": 0, "moe_intermediate_size": 32, "num_local_experts": 8}


def _config(tmp_path: Path, fields: dict[str, int]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize("ep", [None, 4])
def test_moe_config_rehearses(tmp_path: Path, capsys: pytest.CaptureFixture[str], ep: int | None) -> None:
    """The stacks crashed the step ("Muon only supports 2D parameters ... down_experts"): they go in
    a group of their own with "experts": True; with --ep over a (gpus / ep) x ep mesh."""
    argv = ["plan", "--rehearse", _config(tmp_path, MOE), "--gpus", "16", "--skip-ns", "--head-dim", "0"]
    assert cli([*argv, *(["--ep", str(ep)] if ep else [])]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    # 2 layers x (q, k, v, o, router) + 2 layers x 3 stacks (gate, up, down) x 8 experts
    assert "Muon matrices: 58;" in out
    assert ("x EP 4 for the experts" in out) == bool(ep)
    assert f"process groups created: {2 if ep else 0} by the meshes" in out
    # the model prices dense and expert groups (experts.moe_predict): its collectives are the run's
    assert f"| collectives | {6 if ep else 3} | {6 if ep else 3} |" in out
    assert not dist.is_initialized()


def test_busiest_with_ep() -> None:
    """--busiest with --ep was refused (the plans before launch had no ep layout); ``lay_out`` lays
    the stacks out over ep x gpus / ep now (experts Shard(0) over 4 consecutive ranks, rows over the
    4 ranks of each ep rank's group), so the rank comes from the plans the step builds: one plan of
    the dense matrices and one of the 2 x 3 stacks' 8 experts, both over all 16 ranks."""
    laid = lay_out(meta_model(MOE), 16, head_dim=None, ep=4)
    assert sorted(p.group_size for p in laid.plans.values()) == [16, 16]
    assert sorted(len(p.entries) for p in laid.plans.values()) == [2 * 5, 2 * 3 * 8]
    chosen = busiest(laid, 16, Hardware.h200(), 5)
    assert 0 <= chosen.rank < 16 and chosen.why().startswith(f"rank {chosen.rank} has the most modelled work")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head-dim", "7"], "head_dim=7 does not divide the rows"),
        (["--rank", "16"], "--rank 16 must be between 0 and --gpus - 1 (15)"),
        (["--tp", "3"], "must be a positive multiple of --hsdp 1 x --tp 3"),
        (["--steps", "0"], "--steps must be at least 1 but is 0"),
        (["--busiest", "--rank", "2"], "--busiest and --rank 2: give one"),
        (["--shard", "4"], "--shard: not an option of --rehearse"),
        (["--ep", "3"], "--ep 3 must divide --gpus 16"),
        (["--gpus", "0"], "argument --gpus: 0 is below 1"),
        (["--ns-steps", "x"], "argument --ns-steps: 'x' is not an integer"),
    ],
)
def test_bad_arguments_are_an_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    gpus = [] if "--gpus" in argv else ["--gpus", "16"]
    assert cli(["plan", "--rehearse", _config(tmp_path, TINY), *gpus, *argv]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err and "Traceback" not in err, err
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "llama3-8b", "--gpus", "8", "--rank", "3"],
            "--rank: not an option of the cost model's step",
        ),
        (
            ["--model", "llama3-8b", "--gpus", "8", "--hsdp", "2"],
            "--hsdp: not an option of the cost model's step",
        ),
        (["--check", "llama3-8b", "--gpus", "8", "--skip-ns"], "--skip-ns: not an option of --check"),
        (["--check", "llama3-8b", "--rehearse", "llama3-8b"], "not allowed with argument"),
        (["--check", "llama3-8b"], "--check needs --gpus N"),
    ],
)
def test_one_parser_refuses_an_option_of_another_mode(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """The modes are flags of one parser: no argv scan picks a file, so a mode's option given to
    another is refused by name instead of being read by the wrong parser or ignored."""
    assert cli(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_busiest_is_the_rank_with_the_most_modelled_work() -> None:
    """Against every rank priced exactly: its Newton-Schulz flops and bytes sent, from the plans."""
    laid = lay_out(meta_model(TINY | {"num_hidden_layers": 3}), 12, tp=4, head_dim=None)
    hw = Hardware.h200()
    chosen = busiest(laid, 12, hw, 5)

    def cost(rank: int) -> float:
        flops = sum(p.loads[laid.group_rank(rank, a)] for a, p in laid.plans.items()) * 5
        sent = sum(p.bytes_sent(laid.group_rank(rank, a), 2) for a, p in laid.plans.items())
        return flops / hw.matmul_flops + sent / hw.inter_node_bandwidth

    assert cost(chosen.rank) == max(cost(r) for r in range(12))
    assert chosen.rank != 0 and cost(chosen.rank) > cost(
        0
    )  # with TP 4 the default --rank 0 is not the busiest
    assert f"rank {chosen.rank} has the most modelled work" in chosen.why()


def test_busiest_is_rehearsed_and_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, TINY | {"num_hidden_layers": 3})
    assert (
        cli(
            [
                "plan",
                "--rehearse",
                config,
                "--gpus",
                "12",
                "--tp",
                "4",
                "--busiest",
                "--skip-ns",
                "--head-dim",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    laid = lay_out(meta_model(TINY | {"num_hidden_layers": 3}), 12, tp=4, head_dim=None)
    rank = busiest(laid, 12, Hardware.h200(), 5)
    assert rank.rank == 2
    assert f", rank {rank.rank}, fake backend" in out
    assert f"why this rank: rank {rank.rank} has the most modelled work" in out


def _step_ms(text: str, pattern: str) -> float:
    found = re.search(pattern, text)
    assert found, text
    return float(found.group(1))


@pytest.mark.parametrize(
    ("fields", "extra"),
    [
        (TINY, []),
        (TINY, ["--hsdp", "2", "--owners", "mesh"]),
        (TINY, ["--check-backend", "gloo", "--ns-steps", "3"]),
        (MOE, []),
    ],
    ids=["fsdp", "hsdp-mesh", "gloo-ns3", "moe"],
)
def test_check_and_rehearse_print_one_modelled_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, int], extra: list[str]
) -> None:
    """One modelled step per launch: --rehearse priced the check on gloo and --check on nccl (75.2
    against 85.4 ms for 70B on 8,192 ranks); both now call launch_check.modelled_step."""
    config = _config(tmp_path, fields)
    assert cli(["plan", "--check", config, "--gpus", "16", *extra]) == 0
    checked = _step_ms(
        capsys.readouterr().out,
        r"modelled step \(the launch's, as plan --rehearse prints it: .*\): ([\d.]+) ms",
    )
    assert cli(["plan", "--rehearse", config, "--gpus", "16", "--skip-ns", *extra]) == 0
    rehearsed = _step_ms(
        capsys.readouterr().out,
        r"\| modelled step \(the launch's, as plan --check prints it: .*\) \| - \| ([\d.]+) ms \|",
    )
    assert checked == rehearsed


def test_ns_estimate_before_and_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --skip-ns an estimate comes first (on stderr), and the CPU's figures are named as such."""
    assert cli(["plan", "--rehearse", _config(tmp_path, TINY), "--gpus", "4", "--rank", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.search(
        r"Newton-Schulz runs for real on rank 1's matrices: [\d.]+ GFLOP per step x 4 steps, about", err
    )
    assert err.index("Newton-Schulz runs for real") < err.index("first step (set-up and step)")
    assert "| steady step's host time (CPU time, fp32 on one core) |" in out
    assert "| GPU host time (eager ops) of the modelled step | - |" in out
    assert "(CPU model, modelled_setup_s) |" in out


def test_a_set_up_beyond_the_bound_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10,000 tiny layers, or 131,072 ranks, ran past 300 s with no output. The first step's set-up
    is modelled before anything is built, printed, and refused above ``MAX_SETUP_S``."""
    config = TINY | {"num_hidden_layers": 10_000}
    assert modelled_setup_s(70_000, 131_072) > MAX_SETUP_S > modelled_setup_s(560, 8192)
    start = time.process_time()
    assert (
        cli(
            [
                "plan",
                "--rehearse",
                _config(tmp_path, config),
                "--gpus",
                "131072",
                "--skip-ns",
                "--head-dim",
                "0",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error:" in err and "first step's set-up is modelled at" in err and "plan --check prices" in err
    assert time.process_time() - start < 5


def test_the_launch_modes_price_the_check_where_the_step_runs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Above 256 ranks the check runs on the group's CPU backend as a butterfly of two-rank
    all-gathers (a "cuda:nccl,cpu:gloo" job; the fake backend alike). --check and --rehearse price it
    there by default, so the rehearsal's collectives are the model's: priced on nccl, the model said 3
    where 8B on 8,192 ranks ran 15."""
    config = _config(tmp_path, TINY)
    assert cli(["plan", "--rehearse", config, "--gpus", "512", "--skip-ns", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "modelled (H200, the check on gloo)" in out
    found = re.search(r"\| collectives \| (\d+) \| (\d+) \|", out)
    assert found is not None and found[1] == found[2] and int(found[1]) >= 9 + 2, out  # 9 steps, 2 exchanges
    assert cli(["plan", "--check", config, "--gpus", "512"]) == 0
    assert "the check on gloo): " in capsys.readouterr().out
    assert cli(["plan", "--check", config, "--gpus", "512", "--check-backend", "nccl"]) == 0
    assert "the check on nccl): " in capsys.readouterr().out
