"""``python -m muon_dtensor plan``: the cost model's Muon step for a model on a number of GPUs.

Examples::

    python -m muon_dtensor plan --model llama3-8b --gpus 64
    python -m muon_dtensor plan --model llama3-70b --gpus 256 --shard 64     # HSDP: 4 replicas x 64
    python -m muon_dtensor plan --layers 24 --dim 2048 --gpus 8 --matmul-tflops 600
    python -m muon_dtensor plan --model llama3-8b --gpus 8 --json
    python -m muon_dtensor plan --model llama3.1-405b --gpus 512 --ns-algorithm gram

The step is predicted by ``costmodel.predict``. Without replicas, for one shard group (the ranks a
parameter is sharded over, FSDP2's ``Shard(0)``). With HSDP (``--replicate`` > 1), ``--owners``
says where each matrix's owner is chosen, as ``Muon(owners=...)``: ``replica`` (every replica group
runs one shard group's step at the same time), ``mesh`` (one owner per matrix among all GPUs, the
results sent to every replica) or ``auto`` (the faster; the default). Pure arithmetic: no GPU, no
process group.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from ..sharding.plan.build import DEFAULT_ROUND_BYTES
from ..sharding.plan.memory import group_peak
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
from .hardware import Hardware
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
    seconds_or_rate,
)
from .links import block_numels
from .plans import hsdp_plan, sharded_plan

__all__ = ["MODELS", "Layout", "hardware", "main", "memory", "parse_args", "plan"]

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
# Command-line flag -> (Hardware field, factor from the flag's unit to the field's).
_HW_FLAGS = {
    "matmul_tflops": ("matmul_flops", 1e12),
    "memory_tbps": ("memory_bandwidth", 1e12),
    "intra_node_gbps": ("intra_node_bandwidth", 1e9),
    "inter_node_gbps": ("inter_node_bandwidth", 1e9),
    "gpus_per_node": ("gpus_per_node", 1),
    "latency_us": ("collective_latency", 1e-6),
    "op_overhead_us": ("op_overhead", 1e-6),
}


@dataclass(frozen=True)
class Layout:
    """``gpus`` = ``replicate`` replica groups x ``shard`` ranks per shard group."""

    gpus: int
    shard: int
    replicate: int


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, or a transformer given by --layers and --dim)")
    g.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="preset (llama3-8b)")
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
    g.add_argument("--mode", choices=("owner", "gather", "redundant"), default="owner", help="(owner)")
    owner_options(g)
    g.add_argument(
        "--ns-steps", type=bounded(0, MAX_NS_STEPS), default=5, help="Newton-Schulz iterations (5)"
    )
    g.add_argument(
        "--ns-algorithm",
        choices=("standard", "gram"),
        default="standard",
        help='as Muon(ns_algorithm=...); "gram" prices Gram Newton-Schulz flops (standard)',
    )
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


def _hardware_args(p: argparse.ArgumentParser) -> None:
    d = Hardware.h200()
    g = p.add_argument_group("hardware (default: H200 SXM, 8 per node; see muon_dtensor.planning.hardware)")
    for flag, (field, unit) in _HW_FLAGS.items():
        cast = GPUS if field == "gpus_per_node" else seconds_or_rate(field.endswith(("flops", "bandwidth")))
        default = getattr(d, field) / unit
        g.add_argument("--" + flag.replace("_", "-"), type=cast, help=f"(H200: {default:g})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``plan``'s arguments; exits with status 2 on bad ones, as argparse does."""
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan",
        description="Predict one Muon optimizer step from the cost model (no GPU needed); with --check, "
        "check a model's layouts before launch.",
    )
    _model_args(p)
    _layout_args(p)
    _hardware_args(p)
    _check_args(p)
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    args = p.parse_args(argv)
    try:
        args.layout = _layout(args.gpus, args.shard, args.replicate)
        args.shapes = _shapes(args)
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
    if args.layers is None and args.dim is None:
        return MODELS[args.model]
    if args.layers is None or args.dim is None or args.layers < 1 or args.dim < 1:
        raise ValueError("a custom model needs both --layers and --dim (>= 1)")
    return transformer_shapes(
        args.layers, args.dim, kv_rows=args.kv_rows, ffn=args.ffn, gated=args.gated, fused_qkv=args.fused_qkv
    )


def hardware(args: argparse.Namespace) -> Hardware:
    """``Hardware.h200()`` with the fields the flags set."""
    overrides = {
        field: getattr(args, flag) * unit
        for flag, (field, unit) in _HW_FLAGS.items()
        if getattr(args, flag) is not None
    }
    return Hardware.h200(**overrides)


def plan(args: argparse.Namespace) -> Prediction:
    """The cost model's step for parsed arguments: shard groups of ``args.layout.shard`` ranks, in
    ``args.layout.replicate`` replicas with owners ``args.owners``."""
    impl = replace(CURRENT, max_round_bytes=args.max_round_bytes or None)
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


def memory(args: argparse.Namespace, owners: str) -> dict[str, list[int]]:
    """Per rank of one exchange group, the bytes ``Muon.memory`` reports for these matrices: fp32
    momentum and the predicted peak transient of a step (bf16 exchange, CUDA batches), from the
    plan the optimizer would build (owners ``"mesh"``: over every GPU, else one replica group)."""
    lay = args.layout
    shapes = tuple((int(r), int(c)) for r, c in args.shapes)
    mesh = owners == "mesh" and lay.replicate > 1
    momentum, peak = _memory(shapes, lay.shard, lay.replicate, mesh, args.max_round_bytes or None)
    return {"momentum": list(momentum), "peak_transient": list(peak)}


@lru_cache(maxsize=64)
def _memory(
    shapes: tuple[Shape, ...], shard: int, replicate: int, mesh: bool, limit: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``memory``'s figures, computed once per setting (pure; seconds at 1,024 ranks)."""
    built = (
        hsdp_plan(shapes, shard, replicate, max_round_bytes=limit)
        if mesh
        else sharded_plan(shapes, shard, max_round_bytes=limit)
    )
    whole, members = [False] * len(built.entries), list(range(len(built.entries)))
    momentum, peak = [], []
    per_entry = [block_numels(e.blocks) for e in built.entries]
    for rank in range(built.group_size):
        numels = [x[rank] for x in per_entry]
        momentum.append(4 * sum(numels))
        peak.append(
            group_peak(
                numels, whole, [(built, rank, members)], param_item=4, ns_item=2, nesterov=True, cpu=False
            )
        )
    return tuple(momentum), tuple(peak)


def _memory_lines(figures: dict[str, list[int]]) -> list[str]:
    span = {k: f"{format_bytes(min(v))} - {format_bytes(max(v))}" for k, v in figures.items()}
    return [
        "Per rank (min - max over ranks; Muon.memory's figures for these matrices): fp32 momentum "
        f"{span['momentum']}; peak transient of a step (bf16 exchange, CUDA batches) {span['peak_transient']}"
    ]


def _describe(args: argparse.Namespace, hw: Hardware) -> list[str]:
    lay, shapes = args.layout, args.shapes
    name = args.model if args.layers is None else f"custom ({args.layers} layers of width {args.dim})"
    rounds = "one round" if not args.max_round_bytes else f"rounds of {args.max_round_bytes:,} bytes"
    return [
        f"model: {name}, {len(shapes)} hidden matrices, {sum(r * c for r, c in shapes):,} elements",
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
    lines = _describe(args, hw) + ["", f"Predicted Muon step (costmodel.predict), owners {where}:", ""]
    lines += ["| part | ms |", "|---|---:|"] + [f"| {k} | {v * 1e3:.1f} |" for k, v in rows]
    lines += [
        "",
        f"collectives per step: {p.collectives}; sent per rank per step: {p.bytes_sent_mean / 1e6:,.1f} MB "
        f"mean, {p.bytes_sent_max / 1e6:,.1f} MB max; Newton-Schulz imbalance {p.imbalance:.3f} (max / mean)",
        "The parts overlap (all-to-alls behind Newton-Schulz"
        + (", host behind device)" if hw.async_host else ")")
        + ", so the step is less than their sum.",
        f"Every rank orthogonalizing every matrix instead (mode redundant): {redundant.total * 1e3:.1f} ms.",
        *_memory_lines(memory(args, p.owners)),
    ]
    return "\n".join(lines)


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
        print(json.dumps(out | {"prediction": asdict(p), "memory": figures}, indent=2))
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
