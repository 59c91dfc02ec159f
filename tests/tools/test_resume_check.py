"""The resume check on examples/train.py's model (TinyLM, the demo corpus, FSDP2, Muon + AdamW, a
LambdaLR schedule): a plain loop resumes bitwise at 2 -> 2 and not at 2 -> 1, where the report names
the gradient sum order; the micro-batch recipe makes 2 -> 1 bitwise too.

The checks run on the session's pooled ranks (tests/harness/ranks.py) and share their runs: each loop's
uninterrupted run and its save at SAVE_AT run once (``_SharedRuns``), every resume runs on its own.
The tool's own launches (fresh processes, ``muon_dtensor.testing.run_ranks``) run end to end in
test_resume_check_loops; that launcher is also tested by test_rank_failure, test_raising_rank and the
demo (test_demo)."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from muon_dtensor import Muon, split_params, testing
from muon_dtensor.demo.data import batch, corpus, tokens
from muon_dtensor.demo.model import ModelConfig, TinyLM
from muon_dtensor.demo.parallel import shard_model
from muon_dtensor.tools import resume_check
from muon_dtensor.tools.resume_check import loss_scale, micro_batches_for, run_resume_check
from muon_dtensor.tools.resume_report import GRADIENT_ENVELOPE
from muon_dtensor.tools.resume_report import compare as _compare
from tests.harness import ranks

CFG = ModelConfig(vocab=64, dim=32, layers=1, heads=2, seq=16)
BATCH, N_MICRO = 8, 2  # sequences per step; the recipe's micro-batches: one per rank at 2 ranks
STEPS, SAVE_AT = 4, 2


@functools.cache
def _data() -> torch.Tensor:
    return tokens(corpus(20_000))


def _factor(step: int) -> float:
    return 1.0 / (1 + step)


def build(rank: int, world: int) -> tuple[nn.Module, Muon, LambdaLR]:
    torch.manual_seed(0)
    model = TinyLM(CFG)
    shard_model(model, init_device_mesh("cpu", (world,)))
    groups = split_params(model, adamw=["pos"], adamw_options={"lr": 3e-3, "weight_decay": 0.0})
    opt = Muon(groups, lr=0.02, weight_decay=0.1)
    return model, opt, LambdaLR(opt, _factor)


def plain_step(model: nn.Module, opt: Optimizer, sched: LambdaLR, step: int, rank: int, world: int) -> None:
    """examples/train.py's step: this rank's slice of the batch, one mean loss."""
    share = BATCH // world
    model.loss(batch(_data(), step, BATCH, CFG.seq)[rank * share : (rank + 1) * share]).backward()  # type: ignore[operator]
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def recipe_step(model: nn.Module, opt: Optimizer, sched: LambdaLR, step: int, rank: int, world: int) -> None:
    """The micro-batch recipe: the same N_MICRO micro-batches on any world size, each scaled."""
    micros = batch(_data(), step, BATCH, CFG.seq).split(BATCH // N_MICRO)
    for i in micro_batches_for(rank, world, N_MICRO):
        (model.loss(micros[i]) * loss_scale(world, N_MICRO)).backward()  # type: ignore[operator]
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def clipped_step(model: nn.Module, opt: Optimizer, sched: LambdaLR, step: int, rank: int, world: int) -> None:
    """A standard LLM step: this rank's share in two accumulated micro-batches, the norm clipped to 1."""
    share = batch(_data(), step, BATCH, CFG.seq)[rank * (BATCH // world) : (rank + 1) * (BATCH // world)]
    for micro in share.chunk(2):
        (model.loss(micro) / 2).backward()  # type: ignore[operator]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def lossy_build(rank: int, world: int) -> tuple[nn.Module, Muon, LambdaLR]:
    """``build``, whose optimizer loses every other momentum buffer when it loads a state dict."""
    model, opt, sched = build(rank, world)
    loaded: list[bool] = []

    def lose(optimizer: Optimizer, *_: Any) -> None:  # at the first step after a load
        if loaded:
            buffers = [s["momentum_buffer"] for s in optimizer.state.values() if "momentum_buffer" in s]
            for buf in buffers[::2]:
                buf.zero_()
            loaded.clear()

    opt.register_load_state_dict_post_hook(lambda _: loaded.append(True))
    opt.register_step_pre_hook(lose)
    return model, opt, sched


class _SharedRuns:
    """``resume_check``'s launcher here: the pooled ranks; an uninterrupted run (no load, no save)
    and a save run (no load) with the same functions, world size and steps run once, a save's
    checkpoint copied to each caller's folder. Resumed runs (a load) always run."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.done: dict[tuple, tuple[list[Any], str | None]] = {}

    def __call__(self, fn: Any, world: int, *args: Any, timeout: float) -> list[Any]:
        assert fn is resume_check._rank_run, fn
        build_fn, step_fn, load_from, save_to, save_at, last, _ = args
        if load_from is not None:
            return ranks.run_ranks(fn, world, *args, timeout=timeout)
        key = (world, build_fn, step_fn, save_at, last, save_to is not None)
        if key not in self.done:
            saved = str(self.folder / f"save{len(self.done)}") if save_to is not None else None
            values = ranks.run_ranks(
                fn, world, build_fn, step_fn, None, saved, save_at, last, None, timeout=timeout
            )
            self.done[key] = (values, saved)
        values, saved = self.done[key]
        if saved is not None:
            shutil.copytree(saved, save_to, dirs_exist_ok=True)
        return values


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_SharedRuns]:
    assert resume_check.run_ranks is testing.run_ranks  # what the tool launches when not patched
    runs = _SharedRuns(tmp_path_factory.mktemp("resume_check_saves"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resume_check, "run_ranks", runs)
        yield runs


def test_plain_loop_resumes_bitwise_on_the_same_world_size(tmp_path: Path, shared_runs: _SharedRuns) -> None:
    report = tmp_path / "report.json"
    out = run_resume_check(build, plain_step, steps=STEPS, save_at=SAVE_AT, world_sizes=(2, 2), report=report)
    assert out["bitwise"] and out["passed"] and out["cause"] is None, out
    assert json.loads(report.read_text())["bitwise"] is True
    assert out["scheduler_equal"] and out["rng_equal"]
    assert sorted(out["per_step"]) == [str(s) for s in range(SAVE_AT, STEPS + 1)]


def test_plain_loop_on_fewer_ranks_is_not_bitwise_and_names_the_gradient(shared_runs: _SharedRuns) -> None:
    out = run_resume_check(build, plain_step, steps=STEPS, save_at=SAVE_AT, world_sizes=(2, 1))
    assert not out["bitwise"] and not out["passed"], out
    assert out["first_resumed_grads"]["max_diff"] > 0
    assert out["per_step"][str(SAVE_AT)]["max_diff"] == 0  # the load itself is exact
    assert out["first_difference_step"] == SAVE_AT + 1
    assert "gradient sum order differs" in out["cause"] and "2 -> 1" in out["cause"]


def test_micro_batch_recipe_resumes_bitwise_on_fewer_ranks(shared_runs: _SharedRuns) -> None:
    out = run_resume_check(build, recipe_step, steps=STEPS, save_at=SAVE_AT, world_sizes=(2, 1))
    assert out["bitwise"] and out["passed"], out


def test_a_clipped_accumulating_loop_passes_same_gradients_on_fewer_ranks(shared_runs: _SharedRuns) -> None:
    """Clipping, accumulation and a scheduler, 2 -> 1: the gradients differ in their last bits (another
    sum order), so the run is not bitwise; stepped on the uninterrupted run's gradients it is, and its
    own gradients stay within the summation envelope."""
    out = run_resume_check(
        build, clipped_step, steps=STEPS, save_at=SAVE_AT, world_sizes=(2, 1), profile="same_gradients"
    )
    assert out["passed"] and out["gradients"]["within"], out
    assert out["first_resumed_grads"]["max_diff"] > 0 and out["gradients"]["max_rel_diff"] > 0, out
    assert all(v["max_diff"] == 0 for v in out["per_step"].values()), out["per_step"]


@pytest.mark.parametrize("worlds", [(2, 2), (2, 1)])
def test_a_loop_that_loses_momentum_fails_same_gradients(
    shared_runs: _SharedRuns, worlds: tuple[int, int]
) -> None:
    """Half the momentum buffers restart from zero at the load, as round-robin Muon's rank-0 state
    dict makes them: the first resumed update differs, on the same and on fewer ranks."""
    out = run_resume_check(
        lossy_build, plain_step, steps=STEPS, save_at=SAVE_AT, world_sizes=worlds, profile="same_gradients"
    )
    assert not out["passed"] and out["first_failure_step"] == SAVE_AT + 1, out
    assert out["per_step"][str(SAVE_AT + 1)]["max_diff"] > 0


def _run(params: dict[int, dict[str, torch.Tensor]], grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    state = {"w/momentum": torch.ones(2)}
    by_step = {3: grads}  # the gradients of each resumed step (step 3, after the save at 2)
    return {
        "params": params,
        "grads": by_step,
        "lrs": {3: 0.5},
        "state": state,
        "scheduler": {},
        "rng": ["x"],
    }


def test_profiles_bound_the_difference_by_the_arithmetic() -> None:
    one, ulp = torch.ones(2), 2.0**-23
    base = _run({2: {"w": one}, 3: {"w": one}}, {"w": one})
    off = _run({2: {"w": one}, 3: {"w": one + 3 * ulp}}, {"w": one})  # 3 ulps: within 4 x 1 step
    far = _run({2: {"w": one}, 3: {"w": one + 2.0**-10}}, {"w": one})  # 2**-10 <= 0.5 * 2**-8
    same = (2, 2)
    assert _compare(base, base, profile="bitwise", world_sizes=same)["bitwise"]
    assert not _compare(base, off, profile="bitwise", world_sizes=same)["passed"]
    assert _compare(base, off, profile="first_step_float", world_sizes=same)["passed"]
    assert not _compare(base, far, profile="first_step_float", world_sizes=same)["passed"]
    enveloped = _compare(base, far, profile="bf16_envelope", world_sizes=same)
    assert enveloped["passed"] and "sum of the largest group lr" in enveloped["bound"]
    assert enveloped["per_step"]["3"]["bound"] == 2.0**-8 * 0.5  # the bound it used: 2**-8 * lr 0.5
    assert enveloped["optimizer_state"]["bound"] == 2.0**-8 * 1 * 1  # 2**-8 * max|x| * n
    assert (
        _compare(base, off, profile="first_step_float", world_sizes=same)["per_step"]["3"]["bound"] == 4 * ulp
    )
    cause = _compare(base, off, profile="bitwise", world_sizes=same)["cause"]
    assert "gradients agree but the optimizer" in cause
    moved = _run({2: {"w": one}, 3: {"w": one}}, {"w": one})
    moved["state"] = {"w/momentum": torch.ones(2) + 2.0**-9}  # a bf16 rounding of a state of 1, not float32's
    assert _compare(base, moved, profile="bf16_envelope", world_sizes=same)["optimizer_state"]["within"]
    assert not _compare(base, moved, profile="first_step_float", world_sizes=same)["passed"]
    moved["rng"] = ["y"]
    assert not _compare(base, moved, profile="bf16_envelope", world_sizes=same)["passed"]
    loaded_wrong = _run({2: {"w": one * 2}, 3: {"w": one}}, {"w": one})
    assert not _compare(base, loaded_wrong, profile="bf16_envelope", world_sizes=same)["passed"]
    # same_gradients: parameters and state bitwise; the run's own gradients within the envelope
    rounded = _run({2: {"w": one}, 3: {"w": one}}, {"w": one + GRADIENT_ENVELOPE})
    other_batch = _run({2: {"w": one}, 3: {"w": one}}, {"w": one * 1.5})
    assert _compare(base, rounded, profile="same_gradients", world_sizes=same)["passed"]
    assert not _compare(base, other_batch, profile="same_gradients", world_sizes=same)["passed"]
    assert not _compare(base, off, profile="same_gradients", world_sizes=same)["passed"]


def test_bad_input_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(
        ValueError, match="n_micro should be a positive multiple of the world size 2 but is 3"
    ):
        micro_batches_for(0, 2, 3)
    with pytest.raises(ValueError, match="profile should be one of"):
        run_resume_check(build, plain_step, steps=4, save_at=2, profile="close")
    with pytest.raises(ValueError, match="1 <= save_at < steps"):
        run_resume_check(build, plain_step, steps=2, save_at=2)
    with pytest.raises(TypeError, match="train_step should be a module-level function"):
        run_resume_check(build, lambda *a: None, steps=4, save_at=2)
    assert list(micro_batches_for(1, 2, 4)) == [2, 3] and loss_scale(2, 4) == 0.5


def test_api_md_lists_every_profile() -> None:
    from muon_dtensor.tools.resume_check import PROFILES

    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    line = next(x for x in api.splitlines() if x.startswith("- `PROFILES`: "))
    listed = line.split("`(", 1)[1].split(")`", 1)[0]
    assert tuple(x.strip().strip('"') for x in listed.split(",")) == PROFILES, line
    resume = (Path(__file__).resolve().parents[2] / "docs" / "resume.md").read_text()
    assert all(f"| `{p}` |" in resume for p in PROFILES)  # each profile's row of "which loops it fits"
