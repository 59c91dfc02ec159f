"""``python -m muon_dtensor demo``: crash FSDP2 training with Muon midway and resume it on another world size.

Trains a small transformer language model on a generated corpus with one muon_dtensor optimizer (Muon
for hidden matrices, AdamW for the rest), FSDP2-sharded over --world-size ranks (gloo on CPU, NCCL
when GPUs are present). Midway every rank saves its shard of the model and optimizer state with
``save_checkpoint``; two steps later every rank is killed (SIGKILL). The run resumes from the
checkpoint on --resume-world-size ranks and finishes; an uninterrupted run is the reference. Then the
same crash under round-robin Muon (KellerJordan/Muon's distributed scheme), which loses momentum.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from muon_dtensor.checkpoint.manifest import step_dir
from muon_dtensor.testing import RankError, run_ranks

from . import qk_clip, report
from .cpu import CpuProbe, host_cpu, probe
from .model import ModelConfig, TinyLM
from .parallel import LAYOUTS, demo_shape, layout_problem
from .progress import Progress
from .train import CRASHED, RunSpec, train

__all__ = ["main"]

BATCH = 16  # sequences per step (rounded up to a multiple of the micro-batch count)
TIMEOUT = 600.0  # seconds per run of ranks
LOG_EVERY = 10  # steps between the ranks' log lines (loss, tok/s, grad norm, lr, memory: demo/log.py)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=int, default=2, help="ranks of the first run (default 2)")
    p.add_argument("--resume-world-size", type=int, default=1, help="ranks of the resumed run (default 1)")
    p.add_argument("--steps", type=int, default=40, help="training steps; checkpoint at half (default 40)")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="fsdp",
        help="mesh layout (default fsdp); hsdp needs an even --world-size of at least 4, fsdp-tp an even one",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=report.TOLERANCE,
        help="largest parameter difference the verdict accepts (default 1e-2; resumes from 2 ranks "
        "to 1 are bitwise, other world sizes drift by float rounding, more in longer runs)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default runs/demo)")
    p.add_argument(
        "--qk-clip",
        type=float,
        nargs="?",
        const=qk_clip.DEFAULT_THRESHOLD,
        default=None,
        metavar="TAU",
        help="QK-Clip after every step at threshold TAU (default TAU 5.0: this model's largest logit grows "
        "from about 1 to 8) and print the largest logit before and after clipping",
    )
    p.add_argument(
        "--normuon",
        action="store_true",
        help="muon_dtensor's Muon groups use NorMuon (rows normalized by a running second moment, "
        "arXiv 2510.05491), exact under sharding; round-robin Muon stays plain Muon",
    )
    return p


def _check(args: argparse.Namespace) -> str | None:
    if not args.tolerance >= 0:
        return f"--tolerance should be >= 0 but is {args.tolerance}"
    if args.steps < 4:
        return f"--steps should be at least 4 but is {args.steps}"
    if args.qk_clip is not None and not 0 < args.qk_clip < math.inf:
        return f"--qk-clip should be a finite number > 0 but is {args.qk_clip}; try --qk-clip 5"
    for name in ("world_size", "resume_world_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} should be at least 1 but is {getattr(args, name)}"
    return layout_problem(args.layout, args.world_size)


def _base(args: argparse.Namespace, optimizer: str, ns_dtype: str) -> RunSpec:
    # Every data-parallel rank of every run (round-robin's too) gets whole micro-batches.
    count = math.lcm(args.world_size, args.resume_world_size)
    save_at = args.steps // 2
    folder = args.out / "checkpoints" / optimizer
    return RunSpec(
        optimizer=optimizer,
        layout=args.layout if optimizer == "muon_dtensor" else "fsdp",
        steps=args.steps,
        micro_batches=count,
        micro_size=max(1, -(-BATCH // count)),
        folder=str(folder),
        save_at=save_at,
        crash_at=min(save_at + 2, args.steps),
        progress=str(args.out / ".progress"),
        log_every=LOG_EVERY,
        ns_dtype=ns_dtype,
        qk_clip=args.qk_clip,
        normuon=getattr(args, "normuon", False) and optimizer == "muon_dtensor",
    )


def _run(label: str, world: int, spec: RunSpec) -> dict:
    with Progress(label, spec.progress or ""):
        return run_ranks(train, world, spec, timeout=TIMEOUT)[0]


def _crash(label: str, world: int, spec: RunSpec) -> None:
    """Run until every rank SIGKILLs itself; anything else (an error, no crash) is a failure."""
    try:
        _run(label, world, spec)
    except RankError:
        marker = Path(spec.folder, CRASHED)
        if marker.is_file() and int(marker.read_text()) == spec.crash_at:
            return
        raise
    raise RuntimeError(f"the run meant to crash after step {spec.crash_at} finished instead")


def _scenario(args: argparse.Namespace, optimizer: str, first: int, ns_dtype: str) -> report.Outcome:
    """Uninterrupted run, crashing run, resumed run."""
    base = _base(args, optimizer, ns_dtype)
    assert base.save_at is not None and base.crash_at is not None  # _base sets both
    shutil.rmtree(base.folder, ignore_errors=True)
    w, r = args.world_size, args.resume_world_size
    plain = replace(base, save_at=None, crash_at=None, record_from=base.save_at)
    label = lambda i, n, what: f"[{first + i}/6] {optimizer:<12} {report.ranks(n):>8}, {what:<19}"  # noqa: E731
    straight = _run(label(0, w, "uninterrupted"), w, plain)
    _crash(label(1, w, f"killed after {base.crash_at}"), w, base)
    resume = replace(base, save_at=None, crash_at=None, resume=True, record_from=base.save_at)
    resumed = _run(label(2, r, f"resumed from {base.save_at}"), r, resume)
    return report.Outcome(straight, resumed, base.save_at, base.crash_at)


def _backend(args: argparse.Namespace) -> str:
    """GPUs when there is one for every rank; otherwise the CPU, since NCCL cannot put two ranks on
    one GPU. The ranks inherit CUDA_VISIBLE_DEVICES from this process."""
    if not torch.cuda.is_available():
        return "gloo on CPU"
    need, have = max(args.world_size, args.resume_world_size), torch.cuda.device_count()
    if have < need:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return f"gloo on CPU ({have} GPU(s) for {need} ranks)"
    return "NCCL on GPUs"


def precision(cpu: CpuProbe | None) -> tuple[str, str]:
    """(Newton-Schulz dtype name, the line saying why): bf16, the library's default, unless the
    ranks run on a CPU that emulates it (``cpu.probe``), where fp32 is about 50x faster."""
    if cpu is None:
        return "bfloat16", "Newton-Schulz in bfloat16 (the library's default) on GPUs."
    if cpu.emulated:
        why = "bf16 is emulated here, so the demo runs Newton-Schulz in float32 (ns_dtype=torch.float32)"
        return "float32", f"{cpu.describe()}.\n{why}; figures differ from the README's bf16 run."
    return "bfloat16", f"{cpu.describe()}.\nNewton-Schulz in bfloat16 (the library's default)."


def _header(args: argparse.Namespace, backend: str) -> str:
    cfg = ModelConfig()
    count = sum(p.numel() for p in TinyLM(cfg).parameters())
    shape = demo_shape(args.layout, args.world_size).describe()
    resumed = demo_shape(args.layout, args.resume_world_size).describe()
    return (
        f"muon_dtensor demo: a {cfg.layers}-layer transformer LM (dim {cfg.dim}, {count:,} parameters) on a "
        f"generated corpus, {args.steps} steps, {shape}, {backend}.\nOne optimizer: muon_dtensor.Muon for "
        "hidden matrices + AdamW for embeddings, norms and head. Checkpoint at step "
        f"{args.steps // 2}, every rank killed 2 steps later, resumed on {report.ranks(args.resume_world_size)} "
        f"({resumed}).\nEach resumed run is compared with its uninterrupted twin: the same optimizer, data and "
        "seed, never killed. A resume is exact when the resumed run is its twin.\n"
    )


def _show_ours(args: argparse.Namespace, ours: report.Outcome) -> bool:
    w, r = args.world_size, args.resume_world_size
    _show_steps(args, "muon_dtensor", ours)
    folder = _step_folder(args, ours.save_at)
    print(f"\ncheckpoint {folder} (model + optimizer state, each rank wrote its own shards):\n")
    print(report.checkpoint_table(folder))
    ok, line = report.verdict(ours, w, r, args.tolerance)
    print("\n" + line)
    return ok


def _show_steps(args: argparse.Namespace, name: str, outcome: report.Outcome) -> None:
    w, r = args.world_size, args.resume_world_size
    print(
        f"\n{name}: killed after step {outcome.crash_at} and resumed on {report.ranks(r)} from the checkpoint of "
        f"step {outcome.save_at}, against its uninterrupted twin on {report.ranks(w)}:\n"
    )
    print(report.step_table(outcome, w, r))


def _step_folder(args: argparse.Namespace, step: int) -> Path:
    return step_dir(args.out / "checkpoints" / "muon_dtensor", step)


def _show_twins(args: argparse.Namespace, ours: report.Outcome, theirs: report.Outcome) -> None:
    _show_steps(args, "round-robin Muon", theirs)
    ours_bytes = sum(f.stat().st_size for f in _step_folder(args, ours.save_at).iterdir())
    theirs_file = sorted(Path(args.out, "checkpoints", "round_robin").glob("*.pt"))[-1]
    kept, total = theirs.resumed["kept"]
    print(
        f"\nround-robin Muon: {total - kept} of {total} momentum buffers lost (only rank 0's matrices were in "
        "its optimizer.state_dict()),\nso its resumed run left its own uninterrupted trajectory.\n"
    )
    print(report.twin_table(ours, theirs, ours_bytes, theirs_file.stat().st_size))
    print("\nWhat an exact resume is for:")
    for line in report.lessons(ours, theirs, args.world_size, args.resume_world_size):
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    backend = _backend(args)
    cpu = probe() if backend.startswith("gloo") else None
    ns_dtype, why = precision(cpu)
    print(_header(args, backend) + why + "\n", flush=True)
    if args.qk_clip is not None:
        print(
            f"QK-Clip at threshold {args.qk_clip:g} after every step of every run, both optimizers.",
            flush=True,
        )
    if getattr(args, "normuon", False):
        print("NorMuon: muon_dtensor's Muon groups normalize each row of the update (--normuon).\n")
    ours = _scenario(args, "muon_dtensor", 1, ns_dtype)
    ok = _show_ours(args, ours)
    print(
        "\nThe same crash under round-robin Muon (KellerJordan/Muon's distributed scheme: parameter i is "
        "updated by rank i % world,\nwhich alone keeps its momentum; rank 0 saves optimizer.state_dict() "
        "with torch.save; replicated model):\n",
        flush=True,
    )
    theirs = _scenario(args, "round_robin", 4, ns_dtype)
    _show_twins(args, ours, theirs)
    if args.qk_clip is not None:
        _show_clip(args, ours)
    seconds = time.perf_counter() - start
    _write(args, ours, theirs, seconds, cpu)
    print(f"\ndone in {seconds:.0f} s ({_load()})")
    return 0 if ok else 1


def _show_clip(args: argparse.Namespace, ours: report.Outcome) -> None:
    cfg = ModelConfig()
    print("\n" + qk_clip.describe(args.qk_clip))
    print(f"\nmuon_dtensor's uninterrupted run ({report.ranks(args.world_size)}):\n")
    print(qk_clip.table(ours.straight["qk_clip"], cfg.layers * cfg.heads))
    same = qk_clip.same_after_resume(ours.straight, ours.resumed)
    how = (
        "exactly as its twin at every step after the resume (same logits, same heads)"
        if same
        else "NOT as its twin"
    )
    print(f"\nThe resumed run ({report.ranks(args.resume_world_size)}) clipped {how}.")


def environment(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """Where the demo ran. Its figures depend on it: bfloat16 matrix products round differently on
    CPUs with and without native bfloat16 instructions (avx512_bf16, amx_bf16) and on GPUs."""
    cpu, flags = host_cpu(cpuinfo)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON values of their own types (paths as strings); ``qk_clip`` only when given,
    so a run without it writes what it always wrote."""
    out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    if out.get("qk_clip") is None:
        out.pop("qk_clip", None)
    return out


def _summary(outcome: report.Outcome) -> dict[str, Any]:
    clip = {"qk_clip": outcome.straight["qk_clip"]} if "qk_clip" in outcome.straight else {}
    return clip | {
        "losses_uninterrupted": outcome.straight["losses"],
        "losses_resumed": outcome.resumed["losses"],
        "largest_parameter_difference": {s: outcome.difference(s) for s in sorted(outcome.resumed["params"])},
        "momentum_buffers_restored": list(outcome.resumed["kept"]),
        "left_twin_at": outcome.left_twin_at(),
        "save_at": outcome.save_at,
        "crash_at": outcome.crash_at,
    }


def results(
    args: argparse.Namespace,
    ours: report.Outcome,
    theirs: report.Outcome,
    seconds: float,
    cpu: CpuProbe | None = None,
) -> dict[str, Any]:
    """What ``results.json`` holds: typed arguments, where it ran (with the bf16 probe and the
    Newton-Schulz dtype it chose), and each optimizer's runs."""
    env = environment() | {"bf16_probe": None if cpu is None else cpu.as_json()}
    return {
        "args": args_json(args),
        "environment": env | {"ns_dtype": precision(cpu)[0]},
        "seconds": round(seconds, 1),
        "muon_dtensor": _summary(ours),
        "round_robin": _summary(theirs),
    }


def _write(
    args: argparse.Namespace,
    ours: report.Outcome,
    theirs: report.Outcome,
    seconds: float,
    cpu: CpuProbe | None = None,
) -> None:
    path = args.out / "results.json"
    path.write_text(json.dumps(results(args, ours, theirs, seconds, cpu), indent=1))
    png = report.plot(ours, theirs, args.out / "loss.png")
    if png is None:
        print(
            f"\nwrote {path}. For a plot of the loss curves: pip install matplotlib (or, in the repository, pip install -e '.[plot]') and rerun."
        )
    else:
        print(f"\nwrote {path} and {png}")


def _load() -> str:
    """The machine's load, for reading the time: the demo's 2 ranks share the CPUs with whatever else runs."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # not on every platform
        return f"{os.cpu_count()} CPUs"
    return f"load average {one:.1f} over the last minute, {five:.1f} over five, on {os.cpu_count()} CPUs"
