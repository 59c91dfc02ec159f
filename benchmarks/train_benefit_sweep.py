"""The protocol of ``train_benefit.py sweep``, fixed and committed before any of its results was seen.

    python benchmarks/train_benefit.py sweep [--out benchmarks/results/train_benefit.json] [--workers 2]

1. Learning rates, seed 0, 150 steps: AdamW (hidden matrices) 2e-3, 4e-3, 8e-3, 1.6e-2; Muon 0.01,
   0.02, 0.04, 0.08. The best is the lowest final validation loss. While an arm's best is at an edge
   of its values, the next value past that edge (x2 or /2) is run, at most 3 times per arm.
2. 3 seeds (0, 1, 2) at each arm's best; the seed changes the initialization and the batches.
3. Muon's own full schedule (warmup, constant, decay) at 2/3 of the steps (100), 3 seeds, at Muon's
   best lr: steps to AdamW's final loss. If Muon's mean final loss at 100 steps is at or below
   AdamW's mean at 150, Muon needs at most 100 steps; else, if its mean at 150 is below AdamW's, the
   steps are interpolated linearly between (100, mean at 100) and (150, mean at 150); else Muon does
   not reach it.
4. Verdict: Muon wins if all 3 paired differences (Muon minus AdamW, same seed, each at its best lr)
   are negative and the mean gap exceeds twice the seed spread (the larger of the two arms' sample
   standard deviations over the 3 seeds); AdamW wins by the mirrored rule; otherwise the difference
   is not significant at this scale.

Sizing, measured here (2 shared cores, one torch thread): at context 128 a step of 32 x 128 tokens
took 0.47 CPU-s (Muon 0.48, AdamW 0.46; load 5.5-7.5) and the evaluation of all 2,127 held-out
windows 11 CPU-s; a smoke sweep of 17 six-step runs took 9 minutes of wall time at load 12-20 (the
other helpers' tests), about 0.15 of a core per run. The issue's 300 steps of 32 x 128 (about 2.6
core-minutes a run, 37-48 for the protocol) could not end by the deadline at that share, so the
runs were cut to 150 steps of 32 x 64 tokens (about 0.7 core-minutes a run by the same measurement,
14 run-equivalents without extensions, 18 with every one: 10-13 core-minutes).
Runs go 2 at a time (``--workers``), each in its own process with one thread.
Every finished run is written at once, so an interrupted sweep keeps its runs, and a second call
skips the runs already in the file (same settings, same data hash).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, system_info
from benchmarks.train_benefit import ARMS, Setup

__all__ = ["PROTOCOL", "best_lr", "steps_to_target", "summarize", "sweep", "verdict"]

STEPS, SEEDS = 150, (0, 1, 2)
PROTOCOL: dict[str, Any] = {
    "grid": {"adamw": [2e-3, 4e-3, 8e-3, 1.6e-2], "muon": [0.01, 0.02, 0.04, 0.08]},
    "max_extensions": 3,
    "steps": STEPS,
    "short_steps": round(2 * STEPS / 3),
    "seeds": list(SEEDS),
    "rule": "Muon wins if all 3 paired differences (Muon - AdamW, same seed) are negative and the mean gap "
    "exceeds twice the seed spread (the larger sample std of the two arms); AdamW by the mirrored rule; "
    "else not significant",
    "setup": {
        k: v for k, v in Setup("muon", 1.0).__dict__.items() if k not in ("optimizer", "lr", "seed", "steps")
    },
}
Run = dict[str, Any]


def _finals(
    runs: Iterable[Run], arm: str, steps: int, lr: float | None = None, seed: int | None = None
) -> dict[tuple[float, int], float]:
    """``{(lr, seed): final val loss}`` of the arm's runs of ``steps`` steps (one lr / seed if given)."""
    out = {}
    for r in runs:
        s = r["settings"]
        if (
            s["optimizer"] == arm
            and s["steps"] == steps
            and lr in (None, s["lr"])
            and seed in (None, s["seed"])
        ):
            out[(s["lr"], s["seed"])] = r["final_val_loss"]
    return out


def best_lr(runs: Iterable[Run], arm: str, steps: int) -> float | None:
    """The arm's lr with the lowest final validation loss at seed 0 and the full steps."""
    grid = _finals(runs, arm, steps, seed=0)
    return min(grid, key=grid.__getitem__)[0] if grid else None


def _edge_step(runs: list[Run], arm: str, steps: int) -> float | None:
    """The next lr past the edge the arm's best sits on, or None where the best is inside."""
    lrs = sorted(lr for lr, _ in _finals(runs, arm, steps, seed=0))
    best = best_lr(runs, arm, steps)
    if best is None or len(lrs) < 2:
        return None
    if best == lrs[0]:
        return best / 2
    return best * 2 if best == lrs[-1] else None


def steps_to_target(short: float, full: float, target: float, steps: tuple[int, int]) -> float | None:
    """Muon's steps to ``target`` from its mean final losses at ``steps`` = (short, full) (protocol item 3)."""
    if short <= target:
        return float(steps[0])
    if full >= target:
        return None
    return steps[0] + (steps[1] - steps[0]) * (short - target) / (short - full)


def verdict(muon: list[float], adamw: list[float]) -> str:
    """The protocol's verdict on the paired final losses (same seeds, same order)."""
    diffs = [m - a for m, a in zip(muon, adamw, strict=True)]
    spread = max(statistics.stdev(muon), statistics.stdev(adamw))
    gap = statistics.mean(diffs)
    if all(d < 0 for d in diffs) and -gap > 2 * spread:
        return "muon wins"
    if all(d > 0 for d in diffs) and gap > 2 * spread:
        return "adamw wins"
    return "not significant"


def summarize(runs: list[Run], protocol: dict[str, Any]) -> dict[str, Any]:
    """Best lrs, per-arm final losses over the seeds, steps to AdamW's final loss and the verdict."""
    steps, short, seeds = protocol["steps"], protocol["short_steps"], protocol["seeds"]
    best = {arm: best_lr(runs, arm, steps) for arm in ARMS}
    out: dict[str, Any] = {"best_lr": best}
    for arm, n in (("muon", steps), ("adamw", steps), ("muon_short", short)):
        lr = best[arm.split("_")[0]]
        finals = (
            {seed: v for (_, seed), v in _finals(runs, arm.split("_")[0], n, lr=lr).items()} if lr else {}
        )
        out[arm] = {
            "steps": n,
            "finals": finals,
            "mean": _mean(finals.values()),
            "std": _std(finals.values()),
        }
    out["complete"] = all(sorted(out[a]["finals"]) == list(seeds) for a in ("muon", "adamw", "muon_short"))
    if out["complete"]:
        short_mean, muon_mean, adamw_mean = (out[a]["mean"] for a in ("muon_short", "muon", "adamw"))
        out["muon_steps_to_adamw_final"] = steps_to_target(short_mean, muon_mean, adamw_mean, (short, steps))
        m, a = ([out[arm]["finals"][s] for s in seeds] for arm in ("muon", "adamw"))
        out["paired_differences"] = [x - y for x, y in zip(m, a, strict=True)]
        out["verdict"] = verdict(m, a)
    return out


def _mean(values: Iterable[float]) -> float | None:
    v = list(values)
    return statistics.mean(v) if v else None


def _std(values: Iterable[float]) -> float | None:
    v = list(values)
    return statistics.stdev(v) if len(v) > 1 else None


def _key(settings: dict[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True)


def _one(setup: Setup, data: str | None, ranks: int = 1) -> Run:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_benefit.py"),
        "run",
        "--curve",
        f"--ranks={ranks}",
    ]
    cmd += [
        f"--optimizer={setup.optimizer}",
        f"--lr={setup.lr!r}",
        f"--seed={setup.seed}",
        f"--steps={setup.steps}",
    ]
    cmd += [f"--data={data}"] if data else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own session: the scheduler shares CPU per session (autogroup), not per process
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env, cwd=ROOT, start_new_session=True
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class Sweep:
    """Runs batches of setups two at a time, writing the results file after every run."""

    def __init__(self, out: Path, data: str | None, workers: int, protocol: dict[str, Any]) -> None:
        self.out, self.data, self.workers = out, data, workers
        self.doc: dict[str, Any] = {"protocol": protocol, "runs": [], "status": "running"}
        if out.exists():  # a second call keeps the runs already made with the same protocol
            old = json.loads(out.read_text())
            if old.get("protocol") == protocol:
                self.doc.update(runs=old["runs"], data_sha256=old.get("data_sha256"), data=old.get("data"))
        self.start, self.cpu0 = time.perf_counter(), _children_cpu()

    def batch(self, setups: list[Setup]) -> None:
        have = {
            _key(r["settings"]) for r in self.doc["runs"] if r["data_sha256"] == self.doc.get("data_sha256")
        }
        todo = [s for s in setups if _key(s.__dict__) not in have]
        with ThreadPoolExecutor(self.workers) as pool:
            for setup, result in zip(todo, pool.map(lambda s: _one(s, self.data), todo), strict=True):
                print(
                    f"{setup.optimizer} lr={setup.lr:g} seed={setup.seed} steps={setup.steps}: "
                    f"final val {result['final_val_loss']:.4f} ({result['cpu_s']:.0f} CPU-s, load {result['loadavg'][0]:.1f})",
                    flush=True,
                )
                self.doc["runs"].append(result)
                self.doc.setdefault("data", result["data"])
                self.doc.setdefault("data_sha256", result["data_sha256"])
                self.write("running")

    def write(self, status: str) -> None:
        self.doc.update(
            status=status, summary=summarize(self.doc["runs"], self.doc["protocol"]), system=system_info()
        )
        self.doc["sweep"] = {
            "wall_s": round(time.perf_counter() - self.start, 1),
            "cpu_s_of_runs": round(_children_cpu() - self.cpu0, 1),
            "workers": self.workers,
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.doc, indent=1) + "\n")


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def sweep(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="train_benefit.py sweep")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_benefit.json")
    p.add_argument("--data", default=None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS, help="only to try the sweep's code on a short run")
    args = p.parse_args(argv)
    protocol = {**PROTOCOL, "steps": args.steps, "short_steps": round(2 * args.steps / 3)}
    s = Sweep(args.out, args.data, args.workers, protocol)
    steps, short, grid = protocol["steps"], protocol["short_steps"], protocol["grid"]
    pairs = zip(grid["muon"], grid["adamw"], strict=True)
    s.batch([Setup(arm, lr, 0, steps) for pair in pairs for arm, lr in zip(ARMS, pair, strict=True)])
    for _ in range(protocol["max_extensions"]):
        more = [Setup(arm, lr, 0, steps) for arm in ARMS if (lr := _edge_step(s.doc["runs"], arm, steps))]
        if not more:
            break
        s.batch(more)
    best = {arm: best_lr(s.doc["runs"], arm, steps) or 0.0 for arm in ARMS}
    later = [Setup(arm, best[arm], seed, steps) for seed in SEEDS[1:] for arm in ARMS]
    s.batch(later + [Setup("muon", best["muon"], seed, short) for seed in SEEDS])
    s.write("complete")
    print(json.dumps(s.doc["summary"]))


def sharded(argv: list[str]) -> None:
    """Item 2: each arm's best at seed 0 on 2 FSDP2 ranks (gloo), against the sweep's one-process run."""
    p = argparse.ArgumentParser(prog="train_benefit.py sharded")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "train_benefit.json")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "train_benefit_sharded.json")
    args = p.parse_args(argv)
    doc = json.loads(args.results.read_text())
    steps = doc["protocol"]["steps"]
    ones = {arm: _seed0(doc, arm, steps) for arm in ARMS}
    setups = [Setup(arm, ones[arm]["settings"]["lr"], 0, steps) for arm in ARMS]
    with ThreadPoolExecutor(len(setups)) as pool:
        twos = list(pool.map(lambda s: _one(s, None, ranks=2), setups))
    out = {"system": system_info(), "data_sha256": doc["data_sha256"], "arms": {}}
    for arm, two in zip(ARMS, twos, strict=True):
        one = ones[arm]
        pairs = [(a["val_loss"], b["val_loss"]) for a, b in zip(one["curve"], two["curve"], strict=True)]
        pairs.append((one["final_val_loss"], two["final_val_loss"]))
        out["arms"][arm] = {
            "settings": one["settings"],
            "bitwise": all(a == b for a, b in pairs),
            "max_abs_diff": max(abs(a - b) for a, b in pairs),
            "val_losses_one_process": [a for a, _ in pairs],
            "val_losses_two_ranks": [b for _, b in pairs],
            "two_ranks_cpu_s": two["cpu_s"],
            "two_ranks_wall_s": two["wall_s"],
        }
        print(f"{arm}: 2 ranks equal to one process bitwise: {out['arms'][arm]['bitwise']}", flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


def _seed0(doc: dict[str, Any], arm: str, steps: int) -> Run:
    best = doc["summary"]["best_lr"][arm]
    runs = [
        r
        for r in doc["runs"]
        if _key(r["settings"])
        == _key({**r["settings"], "optimizer": arm, "lr": best, "seed": 0, "steps": steps})
    ]
    if not runs:
        raise SystemExit(
            f"sharded: the results hold no seed-0 run of {arm} at lr {best}: run the sweep first"
        )
    return runs[0]
