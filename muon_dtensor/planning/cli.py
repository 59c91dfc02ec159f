"""``python -m muon_dtensor plan``: the cost model's Muon step for a model on a number of GPUs.

Examples::

    python -m muon_dtensor plan --model llama3-8b --gpus 64
    python -m muon_dtensor plan --model llama3-70b --gpus 256 --shard 64     # HSDP: 4 replicas x 64
    python -m muon_dtensor plan --layers 24 --dim 2048 --gpus 8 --matmul-tflops 600
    python -m muon_dtensor plan --model llama3-8b --gpus 8 --json
    python -m muon_dtensor plan --model llama3.1-405b --gpus 512 --ns-algorithm gram
    python -m muon_dtensor plan --model deepseek-v3 --gpus 256 --ep 32      # experts: ep 32 x fsdp 8

The step is predicted by ``costmodel.predict``. Without replicas, for one shard group (the ranks a
parameter is sharded over, FSDP2's ``Shard(0)``). With HSDP (``--replicate`` > 1), ``--owners``
says where each matrix's owner is chosen, as ``Muon(owners=...)``: ``replica`` (every replica group
runs one shard group's step at the same time), ``mesh`` (one owner per matrix among all GPUs, the
results sent to every replica) or ``auto`` (the faster; the default). Pure arithmetic: no GPU, no
process group. MoE presets (``deepseek-v3``, ``kimi-k2``) price dense matrices and expert stacks
as two exchange groups, with ``--ep`` in torchtitan's expert-parallel layout (``experts.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..numerics.newton_schulz import ALGORITHMS
from ..sharding.plan.build import DEFAULT_ROUND_BYTES
from . import experts as moe
from .costmodel import (
    CURRENT,
    LLAMA3_8B,
    LLAMA3_70B,
    LLAMA31_405B,
    Prediction,
    Shape,
    predict,
    transformer_shapes,
)
from .experts import MoEPrediction
from .hardware import Hardware, from_flags, hardware_args
from .inputs import (
    GPUS,
    LAYERS,
    MAX_GPUS,
    MAX_LAYERS,
    MAX_NS_STEPS,
    MAX_WIDTH,
    WIDTH,
    bounded,
    format_bytes,
)
from .plans import MOMENTUM_ITEMS, rank_memory
from .shapes import MoEModel

MOE_MODELS = moe.MOE_MODELS

__all__ = ["MODELS", "MOE_MODELS", "Layout", "hardware", "main", "memory", "moe_step", "parse_args", "plan"]

MODELS: dict[str, list[Shape]] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3.1-405b": LLAMA31_405B,
}
# NorMuon adds to each matrix one m x 1 column in both exchanges and a few row passes on its owner;
# the cost model has no term for them, so a NorMuon step is not priced rather than priced as Muon's.
NORMUON_REFUSAL = (
    "the cost model does not price NorMuon (its extra per matrix: one column of m values in each "
    "all-to-all and a few elementwise row passes on the owner); plan without --normuon for the Muon "
    "step it adds to"
)


@dataclass(frozen=True)
class Layout:
    """``gpus`` = ``replicate`` replica groups x ``shard`` ranks per shard group."""

    gpus: int
    shard: int
    replicate: int


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, or a transformer given by --layers and --dim)")
    g.add_argument(
        "--model", choices=sorted(MODELS | MOE_MODELS), default="llama3-8b", help="preset (llama3-8b)"
    )
    g.add_argument("--layers", type=LAYERS, help=f"transformer layers (replaces --model; <= {MAX_LAYERS:,})")
    g.add_argument("--dim", type=WIDTH, help="model width")
    g.add_argument("--kv-rows", type=WIDTH, help="rows of k and v (kv heads x head size; default: dim)")
    g.add_argument("--ffn", type=WIDTH, help="MLP hidden size (default: 4 x dim)")
    g.add_argument("--gated", action="store_true", help="gated MLP (gate, up, down), as Llama")
    g.add_argument("--fused-qkv", action="store_true", help="q, k, v as one matrix")


def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout (give --gpus, or --shard and --replicate)")
    g.add_argument("--gpus", type=GPUS, help=f"GPUs in all (default: shard x replicate; <= {MAX_GPUS:,})")
    g.add_argument("--shard", type=GPUS, help="ranks per shard group (default: gpus / replicate)")
    g.add_argument("--replicate", type=GPUS, help="replica groups, HSDP (default: gpus / shard, or 1)")
    g.add_argument(
        "--ep",
        type=GPUS,
        help="expert-parallel ranks, with an MoE preset: experts Shard(0) over ep, Shard(1) over the "
        "gpus / ep ranks of each (torchtitan's layout); default: stacks Shard(0) over all ranks",
    )
    g.add_argument("--mode", choices=("owner", "gather", "redundant"), default="owner", help="(owner)")
    owner_options(g)
    g.add_argument(
        "--ns-steps", type=bounded(0, MAX_NS_STEPS), default=5, help="Newton-Schulz iterations (5)"
    )
    g.add_argument(
        "--ns-algorithm",
        choices=ALGORITHMS,
        default="standard",
        help='as Muon(ns_algorithm=...); "gram" prices Gram flops, "aol" standard ones (standard)',
    )
    g.add_argument("--momentum-dtype", choices=tuple(MOMENTUM_ITEMS), default="float32", help="(float32)")
    g.add_argument("--normuon", action="store_true", help=f"refused: {NORMUON_REFUSAL}")


def owner_options(g: Any) -> None:
    """``--owners``, ``--ns-split`` and ``--max-round-bytes``, which ``plan`` and ``plan --check`` share."""
    g.add_argument(
        "--owners", choices=("auto", "mesh", "replica"), default="auto", help="with HSDP, as Muon's (auto)"
    )
    g.add_argument(
        "--ns-split",
        nargs="?",
        const="auto",
        default="off",
        choices=("off", "auto"),
        help='"auto" (or the flag alone): split the largest matrices where it pays, as ns_split="auto" (off)',
    )
    g.add_argument(
        "--max-round-bytes",
        type=bounded(0, 2**62, below=": give a byte count, or 0 for one round"),
        default=DEFAULT_ROUND_BYTES,
        help=f"bytes of full matrices per exchange round; 0: one round ({DEFAULT_ROUND_BYTES})",
    )


def check_options(g: Any) -> None:
    """The options only ``plan --check`` takes, besides ``--check`` itself."""
    g.add_argument("--hsdp", type=GPUS, metavar="R", help="replica groups (HSDP) of --check; default 1")
    g.add_argument("--tp", type=GPUS, metavar="T", help="tensor-parallel ranks of --check; default 1")
    g.add_argument(
        "--head-dim",
        type=bounded(0, MAX_WIDTH),
        metavar="D",
        help="per-head q, k, v groups, as split_params(head_dim=D); default: the config's head_dim, "
        "when it has one; 0: whole matrices",
    )


def _check_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "check before launch (plan --check CONFIG --gpus N; plan --check --help)",
        "Builds the model on meta tensors, lays every Muon matrix out as FSDP2 (x TP, x HSDP) would and "
        "prints per-rank memory, the owners' balance and the step; exit 1 when a layout cannot run. Takes "
        "--gpus, --owners, --ns-split and --max-round-bytes above, and:",
    )
    g.add_argument(
        "--check", metavar="CONFIG", help="a config.json, or a preset: " + ", ".join(sorted(MODELS))
    )
    check_options(g)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``plan``'s arguments; exits with status 2 on bad ones, as argparse does."""
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan",
        description="Predict one Muon optimizer step from the cost model (no GPU needed); with --check, "
        "check a model's layouts before launch.",
    )
    _model_args(p)
    _layout_args(p)
    hardware_args(p)
    _check_args(p)
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    args = p.parse_args(argv)
    try:
        args.layout = _layout(args.gpus, args.shard, args.replicate)
        args.moe = MOE_MODELS.get(args.model) if args.layers is None and args.dim is None else None
        args.shapes = _shapes(args)
        name = args.model if args.layers is None and args.dim is None else "a custom model"
        moe.check_ep(args.moe, name, args.ep, args.layout.shard, args.layout.replicate)
    except ValueError as e:
        p.error(str(e))
    given = [
        f
        for f, v in (("--hsdp", args.hsdp), ("--tp", args.tp), ("--head-dim", args.head_dim))
        if v is not None
    ]
    if given:
        p.error(
            f"{' and '.join(given)} only {'go' if len(given) > 1 else 'goes'} with --check CONFIG; without "
            "it, plan takes --shard and --replicate"
        )
    if args.normuon:
        p.error(f"--normuon: {NORMUON_REFUSAL}")
    if args.ns_split == "auto" and args.ns_algorithm == "gram":
        p.error(
            '--ns-split with --ns-algorithm gram: Muon splits only the standard iteration (ns_split="auto" '
            "splits nothing under gram); drop one of them"
        )
    return args


def _layout(gpus: int | None, shard: int | None, replicate: int | None) -> Layout:
    if gpus is None and shard is None:
        raise ValueError("give --gpus, or --shard (and --replicate)")
    if any(v is not None and v < 1 for v in (gpus, shard, replicate)):
        raise ValueError("--gpus, --shard and --replicate must be >= 1")
    if gpus is None:
        assert shard is not None
        return _within(Layout(shard * (replicate or 1), shard, replicate or 1))
    for flag, size in (("--shard", shard), ("--replicate", replicate)):
        if size is not None and gpus % size:
            raise ValueError(f"--gpus {gpus} is not a multiple of {flag} {size}")
    if shard is None:
        shard = gpus // (replicate or 1)
    replicate = replicate or gpus // shard
    if shard * replicate != gpus:
        raise ValueError(f"--gpus {gpus} is not --shard {shard} x --replicate {replicate}")
    return _within(Layout(gpus, shard, replicate))


def _within(layout: Layout) -> Layout:
    if layout.gpus > MAX_GPUS:
        raise ValueError(
            f"--shard {layout.shard} x --replicate {layout.replicate} = {layout.gpus:,} GPUs is above the "
            f"limit of {MAX_GPUS:,}: more GPUs than any cluster has"
        )
    return layout


def _shapes(args: argparse.Namespace) -> list[Shape]:
    if args.moe is not None:  # every expert a matrix; the pricing reads args.moe
        return list(args.moe.dense) + args.moe.expert_shapes(args.moe.experts)
    if args.layers is None and args.dim is None:
        return MODELS[args.model]
    if args.layers is None or args.dim is None or args.layers < 1 or args.dim < 1:
        raise ValueError("a custom model needs both --layers and --dim (>= 1)")
    return transformer_shapes(
        args.layers, args.dim, kv_rows=args.kv_rows, ffn=args.ffn, gated=args.gated, fused_qkv=args.fused_qkv
    )


def hardware(args: argparse.Namespace) -> Hardware:
    """``Hardware.h200()`` with the fields the flags set."""
    return from_flags(args)


def plan(args: argparse.Namespace) -> Prediction:
    """The cost model's step for parsed arguments: shard groups of ``args.layout.shard`` ranks, in
    ``args.layout.replicate`` replicas with owners ``args.owners``."""
    impl = replace(CURRENT, max_round_bytes=args.max_round_bytes or None)
    if args.moe is not None:
        return moe_step(args).step
    return predict(
        args.shapes,
        args.layout.shard,
        hardware(args),
        mode=args.mode,
        impl=impl,
        ns_steps=args.ns_steps,
        ns_algorithm=args.ns_algorithm,
        replicas=args.layout.replicate,
        owners=args.owners,
        split=args.ns_split == "auto",
    )


def moe_step(args: argparse.Namespace, mode: str | None = None) -> MoEPrediction:
    """An MoE preset's step for parsed arguments (``experts.moe_predict``), in ``args.mode`` or ``mode``."""
    return moe.moe_predict(
        args.moe,
        moe.ExpertLayout(args.layout.shard, args.ep),
        hardware(args),
        mode=mode or args.mode,
        impl=replace(CURRENT, max_round_bytes=args.max_round_bytes or None),
        ns_steps=args.ns_steps,
        ns_algorithm=args.ns_algorithm,
        split=args.ns_split == "auto",
    )


def memory(args: argparse.Namespace, owners: str) -> dict[str, list[int]]:
    """Per rank of one exchange group, the bytes ``Muon.memory`` reports for these matrices: fp32
    momentum and the predicted peak transient of a step (bf16 exchange, CUDA batches), from the
    plan the optimizer would build (owners ``"mesh"``: over every GPU, else one replica group)."""
    lay = args.layout
    if args.moe is not None:
        layout = moe.ExpertLayout(lay.shard, args.ep)
        return moe.moe_memory(args.moe, layout, args.max_round_bytes or None, args.momentum_dtype)
    shapes = tuple((int(r), int(c)) for r, c in args.shapes)
    mesh = owners == "mesh" and lay.replicate > 1
    limit = args.max_round_bytes or None
    momentum, peak = rank_memory(shapes, lay.shard, lay.replicate, mesh, limit, args.momentum_dtype)
    return {"momentum": list(momentum), "peak_transient": list(peak)}


def _memory_lines(figures: dict[str, list[int]], dtype: str) -> list[str]:
    span = {k: f"{format_bytes(min(v))} - {format_bytes(max(v))}" for k, v in figures.items()}
    return [
        f"Per rank (min - max over ranks; Muon.memory's figures for these matrices): {dtype} momentum "
        f"{span['momentum']}; peak transient of a step (bf16 exchange, CUDA batches) {span['peak_transient']}"
    ]


def _describe(args: argparse.Namespace, hw: Hardware) -> list[str]:
    lay, shapes = args.layout, args.shapes
    name = args.model if args.layers is None else f"custom ({args.layers} layers of width {args.dim})"
    if args.moe is not None:
        name += f" ({len(args.moe.dense)} dense, {args.moe.expert_matrices:,} experts)"
    rounds = "one round" if not args.max_round_bytes else f"rounds of {args.max_round_bytes:,} bytes"
    return [
        f"model: {name}, {len(shapes):,} hidden matrices, {sum(r * c for r, c in shapes):,} elements",
        f"layout: {lay.gpus} GPUs = {lay.replicate} replica group(s) x {lay.shard} ranks per shard "
        f"group, {hw.gpus_per_node} GPUs per node",
        f"hardware: bf16 matmul {hw.matmul_flops / 1e12:g} TFLOP/s, memory {hw.memory_bandwidth / 1e12:g} "
        f"TB/s, links {hw.intra_node_bandwidth / 1e9:g} / {hw.inter_node_bandwidth / 1e9:g} GB/s each "
        f"way (in / across nodes), {hw.collective_latency * 1e6:g} us per collective, "
        f"{hw.op_overhead * 1e6:g} us per eager op",
        f"mode: {args.mode}, {args.ns_steps} {args.ns_algorithm} Newton-Schulz steps, {rounds}, "
        f"owners {args.owners}" + (", ns_split auto" if args.ns_split == "auto" else ""),
    ]


def _report(args: argparse.Namespace, p: Prediction, redundant: Prediction) -> str:
    """The human-readable report: setting, a table of the step's parts in ms, traffic, comparison."""
    hw = hardware(args)
    rows = [
        ("step", p.total),
        ("Newton-Schulz (busiest rank)", p.newton_schulz),
        ("all-to-alls", p.comm),
        ("elementwise (memory-bound)", p.memory),
        ("host (eager ops)", p.host),
    ]
    where = "among all GPUs" if p.owners == "mesh" else "in each replica group"
    how = "experts.moe_predict: dense, then experts" if args.moe is not None else "costmodel.predict"
    lines = _describe(args, hw) + ["", f"Predicted Muon step ({how}), owners {where}:", ""]
    lines += ["| part | ms |", "|---|---:|"] + [f"| {k} | {v * 1e3:.1f} |" for k, v in rows]
    lines += [
        "",
        f"collectives per step: {p.collectives}; sent per rank per step: {p.bytes_sent_mean / 1e6:,.1f} MB "
        f"mean, {p.bytes_sent_max / 1e6:,.1f} MB max; Newton-Schulz imbalance {p.imbalance:.3f} (max / mean)",
        "The parts overlap (all-to-alls behind Newton-Schulz"
        + (", host behind device)" if hw.async_host else ")")
        + ", so the step is less than their sum.",
        f"Every rank orthogonalizing every matrix instead (mode redundant): {redundant.total * 1e3:.1f} ms.",
        *_memory_lines(memory(args, p.owners), args.momentum_dtype),
    ]
    if args.moe is not None:
        at = next(i for i, line in enumerate(lines) if line.startswith("collectives per step")) + 1
        lines[at:at] = moe.report_lines(*_moe_parts(args))
    return "\n".join(lines)


def _moe_parts(args: argparse.Namespace) -> tuple[MoEModel, moe.ExpertLayout, MoEPrediction, list[int]]:
    """An MoE preset's model, layout, both groups' steps and the expert matrices each rank owns."""
    layout = moe.ExpertLayout(args.layout.shard, args.ep)
    return args.moe, layout, moe_step(args), moe.expert_owned(args.moe, layout, args.max_round_bytes or None)


def main(argv: list[str] | None = None) -> int:
    """Print the prediction; return the exit status (0, or 2 for bad arguments). ``plan --check``
    is the check before launch (``tools.topology.main``; ``__main__`` routes it there)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or an error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    p = plan(args)
    if args.json:
        out: dict[str, Any] = {"layout": asdict(args.layout), "hardware": asdict(hardware(args))}
        figures = {k: {"min": min(v), "max": max(v)} for k, v in memory(args, p.owners).items()}
        extra = {"experts": moe.moe_json(*_moe_parts(args))} if args.moe is not None else {}
        print(json.dumps(out | {"prediction": asdict(p), "memory": figures} | extra, indent=2))
        return 0
    if args.moe is not None:
        print(_report(args, p, moe_step(args, "redundant").step))
        return 0
    redundant = predict(
        args.shapes,
        args.layout.shard,
        hardware(args),
        mode="redundant",
        ns_steps=args.ns_steps,
        ns_algorithm=args.ns_algorithm,
    )
    print(_report(args, p, redundant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
