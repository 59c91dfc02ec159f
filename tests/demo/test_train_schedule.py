"""``examples/train.py --resume`` continues the learning-rate schedule exactly, refuses a changed
horizon, and rebuilds it only when ``--stretch-schedule`` says so (one rank, the pooled runner)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

from tests.harness.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180.0  # seconds per run; 2 shared cores
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch-size", "4", "--warmup", "2"]
LINE = re.compile(r"^step (\d+)/(\d+) loss ([\d.]+) lr ([\d.]+) ", re.M)


def _example() -> ModuleType:
    name = "_example_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "train.py")
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def _train(argv: list[str]) -> str:
    """Rank function: ``examples/train.py``'s training (without torchrun's set-up and exit); its log."""
    example, out = _example(), io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            example.train(example.parse(argv))
        except SystemExit as e:
            print(f"SystemExit: {e}")
    return out.getvalue()


def _run(*argv: str) -> str:
    return run_ranks(_train, 1, [*TINY, "--log-every", "1", "--save-every", "3", *argv], timeout=TIMEOUT)[0]


def _steps(log: str) -> dict[int, tuple[str, str]]:
    """Step -> (loss, lr) as logged."""
    return {int(m[1]): (m[3], m[4]) for m in LINE.finditer(log)}


def test_resume_continues_the_schedule_exactly(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    straight = _steps(_run("--steps", "6", "--ckpt", ckpt))
    shutil.rmtree(tmp_path / "ckpt" / "step_00000006")  # as if killed after step 5
    log = _run("--steps", "6", "--ckpt", ckpt, "--resume")
    assert "resumed from" in log and "(data position 3)" in log, log
    resumed = _steps(log)
    assert sorted(resumed) == [4, 5, 6], log
    assert {s: straight[s] for s in resumed} == resumed  # same losses and learning rates


def test_a_changed_horizon_is_refused_unless_stretched(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    _run("--steps", "6", "--ckpt", ckpt)
    refused = _run("--steps", "8", "--ckpt", ckpt, "--resume")
    assert "SystemExit: error: the checkpoint's learning-rate schedule differs from this run's" in refused
    assert "(--steps 6 -> 8)" in refused and "Resume with --warmup 2 --steps 6 --min-lr-ratio 0.1" in refused
    assert "add --stretch-schedule" in refused, refused
    assert not _steps(refused), "a refused resume trained"

    stretched = _run("--steps", "8", "--ckpt", ckpt, "--resume", "--stretch-schedule")
    args = _example().parse(["--steps", "8", "--warmup", "2"])
    factor = _example().lr_factor(6, warmup=2, total=8, floor=args.min_lr_ratio)
    floor = args.lr * args.min_lr_ratio  # where the 6-step cosine ended
    note = f"--stretch-schedule: the checkpoint's learning-rate schedule differs from this run's (--steps 6 -> 8); lr {floor:.5f} -> {args.lr * factor:.5f}"
    assert note in stretched, stretched
    steps = _steps(stretched)
    assert sorted(steps) == [7, 8] and steps[7][1] == f"{args.lr * factor:.5f}", stretched
