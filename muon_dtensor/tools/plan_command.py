"""``python -m muon_dtensor plan``: one command, one parser (``plan_flags``), three modes.

Examples::

    python -m muon_dtensor plan --model llama3-8b --gpus 64
    python -m muon_dtensor plan --model llama3-70b --gpus 256 --shard 64     # HSDP: 4 replicas x 64
    python -m muon_dtensor plan --layers 24 --dim 2048 --gpus 8 --matmul-tflops 600 --json
    python -m muon_dtensor plan --model deepseek-v3 --gpus 256 --ep 32      # experts: ep 32 x fsdp 8
    python -m muon_dtensor plan --check llama3-70b --gpus 1024 --hsdp 8 --tp 8
    python -m muon_dtensor plan --rehearse llama3-70b --gpus 8192 --busiest --skip-ns

Without a mode flag it prints the cost model's step (``costmodel.predict``; MoE presets through
``experts.moe_predict``): for one shard group, or with HSDP (``--replicate`` > 1) with ``--owners``
as ``Muon(owners=...)``. ``--check CONFIG`` is the check before launch (``launch_check``) and
``--rehearse CONFIG`` one rank's real step on the fake backend (``rehearse_report``); both price
the step with the same function (``launch_check.modelled_step``) on the same hardware flags.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from ..planning import experts as moe
from ..planning.costmodel import CURRENT, Prediction, predict, transformer_shapes
from ..planning.experts import MoEPrediction
from ..planning.hardware import Hardware
from ..planning.inputs import Layout, format_bytes, layout
from ..planning.plans import rank_memory
from ..planning.shapes import LLAMA3_8B, LLAMA3_70B, LLAMA31_405B, MoEModel, Shape
from .plan_flags import hardware, launch_args, parser, refuse_other_modes

__all__ = ["MODELS", "MOE_MODELS", "Layout", "hardware", "main", "memory", "moe_step", "parse_args", "plan"]

MODELS: dict[str, list[Shape]] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3.1-405b": LLAMA31_405B,
}
MOE_MODELS = moe.MOE_MODELS
# NorMuon adds to each matrix one m x 1 column in both exchanges and a few row passes on its owner;
# the cost model has no term for them, so a NorMuon step is not priced rather than priced as Muon's.
NORMUON_REFUSAL = (
    "the cost model does not price NorMuon (its extra per matrix: one column of m values in each "
    "all-to-all and a few elementwise row passes on the owner); plan without --normuon for the Muon "
    "step it adds to"
)


def parse_args(argv: Sequence[str] | None = None) -> Any:
    """Parse ``plan``'s arguments (``args.command``: ``"predict"``, ``"check"`` or ``"rehearse"``);
    exits with status 2 on bad ones, as argparse does. The cost model's step gets ``layout`` (a
    ``Layout``), ``moe`` and ``shapes``; the launch modes ``hsdp``, ``tp`` and a CONFIG."""
    p = parser(sorted(MODELS | MOE_MODELS))
    args = p.parse_args(None if argv is None else list(argv))
    refuse_other_modes(p, args)
    if args.command == "predict":
        _predict_args(p, args)
    else:
        launch_args(p, args)
    return args


def _predict_args(p: Any, args: Any) -> None:
    args.model = args.model or "llama3-8b"
    args.mode, args.momentum_dtype = args.mode or "owner", args.momentum_dtype or "float32"
    try:
        args.layout = layout(args.gpus, args.shard, args.replicate)
        custom = args.layers is not None or args.dim is not None
        args.moe = None if custom else MOE_MODELS.get(args.model)
        args.shapes = _shapes(args)
        moe.check_ep(
            args.moe,
            "a custom model" if custom else args.model,
            args.ep,
            args.layout.shard,
            args.layout.replicate,
        )
    except ValueError as e:
        p.error(str(e))
    if args.normuon:
        p.error(f"--normuon: {NORMUON_REFUSAL}")
    if args.ns_split == "auto" and args.ns_algorithm == "gram":
        p.error(
            '--ns-split with --ns-algorithm gram: Muon splits only the standard iteration (ns_split="auto" '
            "splits nothing under gram); drop one of them"
        )


def _shapes(args: Any) -> list[Shape]:
    if args.moe is not None:  # every expert a matrix; the pricing reads args.moe
        return list(args.moe.dense) + args.moe.expert_shapes(args.moe.experts)
    if args.layers is None and args.dim is None:
        return MODELS[args.model]
    if args.layers is None or args.dim is None:
        raise ValueError("a custom model needs both --layers and --dim (>= 1)")
    return transformer_shapes(
        args.layers, args.dim, kv_rows=args.kv_rows, ffn=args.ffn, gated=args.gated, fused_qkv=args.fused_qkv
    )


def plan(args: Any) -> Prediction:
    """The cost model's step for parsed arguments: shard groups of ``args.layout.shard`` ranks, in
    ``args.layout.replicate`` replicas with owners ``args.owners``."""
    if args.moe is not None:
        return moe_step(args).step
    return predict(
        args.shapes, args.layout.shard, hardware(args), mode=args.mode,
        impl=replace(CURRENT, max_round_bytes=args.max_round_bytes or None), ns_steps=args.ns_steps,
        ns_algorithm=args.ns_algorithm, replicas=args.layout.replicate, owners=args.owners,
        split=args.ns_split == "auto",
    )  # fmt: skip


def moe_step(args: Any, mode: str | None = None) -> MoEPrediction:
    """An MoE preset's step for parsed arguments (``experts.moe_predict``), in ``args.mode`` or ``mode``."""
    return moe.moe_predict(
        args.moe, moe.ExpertLayout(args.layout.shard, args.ep), hardware(args), mode=mode or args.mode,
        impl=replace(CURRENT, max_round_bytes=args.max_round_bytes or None), ns_steps=args.ns_steps,
        ns_algorithm=args.ns_algorithm, split=args.ns_split == "auto",
    )  # fmt: skip


def memory(args: Any, owners: str) -> dict[str, list[int]]:
    """Per rank of one exchange group, the bytes ``Muon.memory`` reports for these matrices: fp32
    momentum and the predicted peak transient of a step (bf16 exchange, CUDA batches), from the
    plan the optimizer would build (owners ``"mesh"``: over every GPU, else one replica group)."""
    lay = args.layout
    if args.moe is not None:
        return moe.moe_memory(
            args.moe, moe.ExpertLayout(lay.shard, args.ep), args.max_round_bytes or None, args.momentum_dtype
        )
    shapes = tuple((int(r), int(c)) for r, c in args.shapes)
    mesh = owners == "mesh" and lay.replicate > 1
    momentum, peak = rank_memory(
        shapes, lay.shard, lay.replicate, mesh, args.max_round_bytes or None, args.momentum_dtype
    )
    return {"momentum": list(momentum), "peak_transient": list(peak)}


def _describe(args: Any, hw: Hardware) -> list[str]:
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
        f"{hw.op_overhead * 1e6:g} us per eager op, the check on {hw.check_backend}",
        f"mode: {args.mode}, {args.ns_steps} {args.ns_algorithm} Newton-Schulz steps, {rounds}, "
        f"owners {args.owners}" + (", ns_split auto" if args.ns_split == "auto" else ""),
    ]


def _report(args: Any, p: Prediction, redundant: Prediction) -> str:
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
    figures = memory(args, p.owners)
    span = {k: f"{format_bytes(min(v))} - {format_bytes(max(v))}" for k, v in figures.items()}
    lines += [
        "",
        f"collectives per step: {p.collectives}; sent per rank per step: {p.bytes_sent_mean / 1e6:,.1f} MB "
        f"mean, {p.bytes_sent_max / 1e6:,.1f} MB max; Newton-Schulz imbalance {p.imbalance:.3f} (max / mean)",
        "The parts overlap (all-to-alls behind Newton-Schulz"
        + (", host behind device)" if hw.async_host else ")")
        + ", so the step is less than their sum.",
        f"Every rank orthogonalizing every matrix instead (mode redundant): {redundant.total * 1e3:.1f} ms.",
        f"Per rank (min - max over ranks; Muon.memory's figures for these matrices): {args.momentum_dtype} "
        f"momentum {span['momentum']}; peak transient of a step (bf16 exchange, CUDA batches) {span['peak_transient']}",
    ]
    if args.moe is not None:
        at = next(i for i, line in enumerate(lines) if line.startswith("collectives per step")) + 1
        lines[at:at] = moe.report_lines(*_moe_parts(args))
    return "\n".join(lines)


def _moe_parts(args: Any) -> tuple[MoEModel, moe.ExpertLayout, MoEPrediction, list[int]]:
    """An MoE preset's model, layout, both groups' steps and the expert matrices each rank owns."""
    lay = moe.ExpertLayout(args.layout.shard, args.ep)
    return args.moe, lay, moe_step(args), moe.expert_owned(args.moe, lay, args.max_round_bytes or None)


def _predict_main(args: Any) -> int:
    p = plan(args)
    if args.json:
        out: dict[str, Any] = {"layout": asdict(args.layout), "hardware": asdict(hardware(args))}
        figures = {k: {"min": min(v), "max": max(v)} for k, v in memory(args, p.owners).items()}
        extra = {"experts": moe.moe_json(*_moe_parts(args))} if args.moe is not None else {}
        print(json.dumps(out | {"prediction": asdict(p), "memory": figures} | extra, indent=2))
        return 0
    if args.moe is not None:
        redundant = moe_step(args, "redundant").step
    else:
        redundant = predict(
            args.shapes, args.layout.shard, hardware(args), mode="redundant", ns_steps=args.ns_steps,
            ns_algorithm=args.ns_algorithm,
        )  # fmt: skip
    print(_report(args, p, redundant))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plan``; return the exit status: 0, 1 when ``--check`` finds a layout that cannot run, 2
    for bad arguments (an ``error:`` line, as argparse prints them)."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse: --help (0) or an error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    if args.command == "check":
        from .check_report import run_check

        return run_check(args)
    if args.command == "rehearse":
        from .rehearse_report import run_rehearsal

        return run_rehearsal(args)
    return _predict_main(args)
