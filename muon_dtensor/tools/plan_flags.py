"""``plan``'s one parser: the cost model's step (no mode flag), ``--check CONFIG`` (the check before
launch) and ``--rehearse CONFIG`` (one rank's real step), each option refused outside the modes it
belongs to, naming the flag and the mode; argparse types that refuse a value naming it and the range."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from ..numerics.newton_schulz import ALGORITHMS
from ..planning.hardware import HW_FLAGS, Hardware
from ..planning.inputs import MAX_GPUS, MAX_LAYERS, MAX_NS_STEPS, MAX_WIDTH
from ..planning.plans import MOMENTUM_ITEMS
from ..sharding.plan.build import DEFAULT_ROUND_BYTES
from .configs import PRESETS

__all__ = [
    "GPUS",
    "LAYERS",
    "WIDTH",
    "bounded",
    "hardware",
    "parser",
    "refuse_other_modes",
    "seconds_or_rate",
]


def bounded(low: int, high: int, above: str = "", below: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high``; a refusal names the value, the bound
    it crosses and why (``above``, ``below``; argparse puts the flag in front)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value:,} is below {low:,}{below}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{value:,} is above the limit of {high:,}{above}")
        return value

    parse.__name__ = "int"
    return parse


GPUS = bounded(1, MAX_GPUS, ": more GPUs than any cluster has")
LAYERS = bounded(1, MAX_LAYERS, ": more layers than any model has")
WIDTH = bounded(1, MAX_WIDTH, ": wider than any model's matrices (2**20)")


def seconds_or_rate(positive: bool) -> Callable[[str], float]:
    """An argparse ``type``: a finite float, > 0 (a rate) or >= 0 (a time)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number {'> 0' if positive else '>= 0'}")
        return value

    parse.__name__ = "float"
    return parse


def hardware(args: argparse.Namespace) -> Hardware:
    """``Hardware.h200()`` with the fields the hardware flags set: every mode prices one machine."""
    overrides: dict[str, Any] = {
        field: getattr(args, flag) * unit
        for flag, (field, unit) in HW_FLAGS.items()
        if getattr(args, flag) is not None
    }
    launch = getattr(args, "check", None) is not None or getattr(args, "rehearse", None) is not None
    backend = getattr(args, "check_backend", None) or (LAUNCH_CHECK_BACKEND if launch else None)
    if backend:
        overrides["check_backend"] = backend
    return Hardware.h200(**overrides)


# The check of --check and --rehearse, where the step runs it in torchtitan's "cuda:nccl,cpu:gloo"
# job: on the group's CPU backend (runtime.comm._reduce_on_host), as the rehearsal's fake groups do,
# so the rehearsal's collectives are the model's; --check-backend nccl for a job with no CPU backend.
LAUNCH_CHECK_BACKEND = "gloo"


def _hardware_args(p: argparse.ArgumentParser) -> None:
    d = Hardware.h200()
    g = p.add_argument_group(
        "hardware, every mode (default: H200 SXM, 8 per node; muon_dtensor.planning.hardware)"
    )
    for flag, (field, unit) in HW_FLAGS.items():
        cast = GPUS if field == "gpus_per_node" else seconds_or_rate(field.endswith(("flops", "bandwidth")))
        g.add_argument("--" + flag.replace("_", "-"), type=cast, help=f"(H200: {getattr(d, field) / unit:g})")
    g.add_argument(
        "--check-backend",
        choices=("nccl", "gloo"),
        help="where the step's check runs: gloo (a CPU group, as 'cuda:nccl,cpu:gloo') costs a ring's "
        "hops of 20 us, a butterfly of two-rank steps above 256 ranks; nccl one collective latency "
        "(default: gloo for --check and --rehearse, where the step runs it in such a job; nccl for the "
        "cost model's table)",
    )


# Options of one mode only, with the mode that takes them: anything else refuses them by name.
PREDICT_ONLY = (
    "model",
    "layers",
    "dim",
    "kv_rows",
    "ffn",
    "shard",
    "replicate",
    "mode",
    "momentum_dtype",
    "json",
)
LAUNCH_ONLY = ("hsdp", "tp", "head_dim")
REHEARSE_ONLY = ("rank", "busiest", "steps", "skip_ns")
PREDICT_FLAGS = ("gated", "fused_qkv", "normuon")  # store_true: refused when set


def _model_args(p: argparse.ArgumentParser, models: Sequence[str]) -> None:
    g = p.add_argument_group(
        "the cost model's step (no --check or --rehearse): a preset, or --layers and --dim"
    )
    g.add_argument("--model", choices=sorted(models), help="preset (llama3-8b)")
    g.add_argument("--layers", type=LAYERS, help=f"transformer layers (replaces --model; <= {MAX_LAYERS:,})")
    g.add_argument("--dim", type=WIDTH, help="model width")
    g.add_argument("--kv-rows", type=WIDTH, help="rows of k and v (kv heads x head size; default: dim)")
    g.add_argument("--ffn", type=WIDTH, help="MLP hidden size (default: 4 x dim)")
    g.add_argument("--gated", action="store_true", help="gated MLP (gate, up, down), as Llama")
    g.add_argument("--fused-qkv", action="store_true", help="q, k, v as one matrix")
    g.add_argument("--shard", type=GPUS, help="ranks per shard group (default: gpus / replicate)")
    g.add_argument("--replicate", type=GPUS, help="replica groups, HSDP (default: gpus / shard, or 1)")
    g.add_argument("--mode", choices=("owner", "gather", "redundant"), help="(owner)")
    g.add_argument("--momentum-dtype", choices=tuple(MOMENTUM_ITEMS), help="(float32)")
    g.add_argument("--normuon", action="store_true", help="refused: the cost model does not price NorMuon")
    g.add_argument("--json", action="store_true", help="print the prediction as JSON")


def _step_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the optimizer, every mode")
    g.add_argument("--gpus", type=GPUS, help=f"GPUs in all (<= {MAX_GPUS:,}); --check and --rehearse need it")
    g.add_argument(
        "--ep",
        type=GPUS,
        help="expert-parallel ranks, with an MoE model (a preset such as deepseek-v3, or a config.json "
        "with experts), in every mode: experts Shard(0) over ep, Shard(1) over the gpus / ep ranks of "
        "each (torchtitan's layout; no --hsdp or --tp); default: stacks Shard(0) over all ranks",
    )
    g.add_argument(
        "--owners", choices=("auto", "mesh", "replica"), default="auto", help="with HSDP, as Muon's (auto)"
    )
    g.add_argument(
        "--ns-split", nargs="?", const="auto", default="off", choices=("off", "auto"),
        help='"auto" (or the flag alone): split the largest matrices where it pays, as ns_split="auto" (off)',
    )  # fmt: skip
    g.add_argument(
        "--max-round-bytes",
        type=bounded(0, 2**62, below=": give a byte count, or 0 for one round"),
        default=DEFAULT_ROUND_BYTES,
        help=f"bytes of full matrices per exchange round; 0: one round ({DEFAULT_ROUND_BYTES})",
    )
    g.add_argument(
        "--ns-steps", type=bounded(0, MAX_NS_STEPS), default=5, help="Newton-Schulz iterations (5)"
    )
    g.add_argument(
        "--ns-algorithm", choices=ALGORITHMS, default="standard",
        help='as Muon(ns_algorithm=...); "gram" prices Gram flops, "aol" standard ones (standard)',
    )  # fmt: skip


def _launch_args(p: argparse.ArgumentParser) -> None:
    presets = ", ".join(PRESETS)
    g = p.add_argument_group(
        "before launch: --check or --rehearse, on a config.json or a preset (--gpus needed)",
        "--check builds the model on meta tensors, lays every Muon matrix out as FSDP2 (x TP, x HSDP) would "
        "and prints per-rank memory, the owners' balance and the step; exit 1 when a layout cannot run. "
        "--rehearse runs one rank's real step on torch's fake backend and prints what it measured beside "
        "the cost model's figures.",
    )
    modes = g.add_mutually_exclusive_group()
    # optional values, so that "plan --check --help" prints this help
    modes.add_argument(
        "--check", nargs="?", const="", metavar="CONFIG", help=f"config.json or a preset ({presets})"
    )
    modes.add_argument(
        "--rehearse", nargs="?", const="", metavar="CONFIG", help=f"config.json or a preset ({presets})"
    )
    g.add_argument("--hsdp", type=GPUS, metavar="R", help="replica groups (HSDP); default 1")
    g.add_argument("--tp", type=GPUS, metavar="T", help="tensor-parallel ranks; default 1")
    g.add_argument(
        "--head-dim", type=bounded(0, MAX_WIDTH), metavar="D",
        help="per-head q, k, v groups, as split_params(head_dim=D); default: the config's head_dim, when it "
        "has one; 0: whole matrices",
    )  # fmt: skip
    r = p.add_argument_group("--rehearse only")
    r.add_argument("--rank", type=int, help="the rank this process plays (0)")
    r.add_argument(
        "--busiest",
        action="store_true",
        help="play the rank with the most modelled work (its Newton-Schulz flops and bytes sent, from the "
        "plans, with no process) instead of --rank; the output says why it was chosen",
    )
    r.add_argument("--steps", type=int, help="steady steps timed (2)")
    r.add_argument(
        "--skip-ns",
        action="store_true",
        help="skip Newton-Schulz on the matrices this rank owns (on a CPU, minutes per large matrix); "
        "without it the rehearsal prints an estimate first, then its progress",
    )


def parser(models: Sequence[str]) -> argparse.ArgumentParser:
    """The ``plan`` command's parser; ``models``: the presets of the cost model's step."""
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan",
        description="Predict one Muon optimizer step from the cost model (no GPU needed); with --check CONFIG, "
        "check a model's layouts before launch; with --rehearse CONFIG, run one rank's real step.",
    )
    _model_args(p, models)
    _step_args(p)
    _launch_args(p)
    _hardware_args(p)
    return p


def refuse_other_modes(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2) naming every flag given to a mode that does not take it."""
    mode = "check" if args.check is not None else "rehearse" if args.rehearse is not None else "predict"
    wrong = [k for k in PREDICT_ONLY if mode != "predict" and getattr(args, k) not in (None, False)]
    wrong += [k for k in PREDICT_FLAGS if mode != "predict" and getattr(args, k)]
    wrong += [k for k in LAUNCH_ONLY if mode == "predict" and getattr(args, k) is not None]
    wrong += [k for k in REHEARSE_ONLY if mode != "rehearse" and getattr(args, k) not in (None, False)]
    if wrong:
        flags = " and ".join("--" + k.replace("_", "-") for k in wrong)
        where = {
            "predict": "the cost model's step (plan without --check or --rehearse)",
            "check": "--check",
            "rehearse": "--rehearse",
        }[mode]
        p.error(f"{flags}: not an option of {where}; plan --help lists each mode's options")
    args.command = mode


def launch_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--check`` and ``--rehearse``: a CONFIG, ``--gpus``, a mesh that divides it and a rank in it
    (``--hsdp``, ``--tp`` default 1; ``--rank`` 0, ``--steps`` 2); ``p.error`` (exit 2) otherwise."""
    flag = "--" + args.command
    if not getattr(args, args.command):
        p.error(f"{flag} needs a CONFIG: a config.json file or a preset ({', '.join(PRESETS)})")
    if args.gpus is None:
        p.error(f"{flag} needs --gpus N, the ranks in all")
    args.hsdp, args.tp = args.hsdp or 1, args.tp or 1
    if args.gpus % (args.hsdp * args.tp):
        p.error(f"--gpus {args.gpus} must be a positive multiple of --hsdp {args.hsdp} x --tp {args.tp}")
    if args.ep is not None and (args.hsdp > 1 or args.tp > 1):
        p.error(f"--ep {args.ep} with --hsdp or --tp: {flag} lays experts out over ep x fsdp only")
    if args.ep is not None and args.gpus % args.ep:
        p.error(f"--ep {args.ep} must divide --gpus {args.gpus} (ep groups of gpus / ep ranks)")
    if args.command != "rehearse":
        return
    if args.busiest and args.rank is not None:
        p.error(f"--busiest and --rank {args.rank}: give one (--busiest chooses the rank)")
    args.rank = 0 if args.rank is None else args.rank
    args.steps = 2 if args.steps is None else args.steps
    if not 0 <= args.rank < args.gpus:
        p.error(f"--rank {args.rank} must be between 0 and --gpus - 1 ({args.gpus - 1})")
    if args.steps < 1:
        p.error(f"--steps must be at least 1 but is {args.steps}")
