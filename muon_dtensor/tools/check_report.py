"""``plan --check``'s run and report: the model, the layout, the owners' balance, per-rank bytes and
the launch's one modelled step (``launch_step``, which ``plan --rehearse`` prints too); exit 1 naming
the parameter and the fix when a layout cannot run, 2 for a config that cannot be checked."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..planning.costmodel import Prediction
from ..planning.experts import check_ep
from ..planning.inputs import format_bytes
from ..planning.shapes import MoEModel
from .configs import load_config, meta_model, muon_matrices, validate_config
from .launch_check import IMBALANCE_HINT, LONG_CHECK, Check, check, modelled_step, moe_model
from .plan_flags import hardware

__all__ = ["check_launch_ep", "launch_step", "priced_by", "report", "run_check"]


def _head_dim(args: Any, config: Mapping[str, Any]) -> tuple[int | None, str]:
    """The rows per head q, k, v are cut in (None: whole matrices), and where that came from."""
    if args.head_dim is not None:
        return args.head_dim or None, "--head-dim"
    return config.get("head_dim") or None, "the config's head_dim"


def launch_step(
    args: Any, shapes: Sequence[tuple[int, int]], split: bool | None = None, moe: MoEModel | None = None
) -> Prediction:
    """The one modelled step of a launch (``launch_check.modelled_step``) for parsed arguments, which
    ``--check`` and ``--rehearse`` both print: the same hardware flags, owners and Newton-Schulz. An
    MoE model (``launch_check.moe_model``) without replicas is priced as dense and expert groups
    (``experts.moe_predict``, ``--ep`` as torchtitan lays experts out)."""
    split = args.ns_split == "auto" if split is None else split
    return modelled_step(
        shapes, args.gpus, hsdp=args.hsdp, hw=hardware(args), owners=args.owners,
        max_round_bytes=args.max_round_bytes or None, ns_steps=args.ns_steps, ns_algorithm=args.ns_algorithm,
        split=split, moe=moe, ep=getattr(args, "ep", None),
    )  # fmt: skip


def check_launch_ep(args: Any, moe: MoEModel | None, config: str) -> None:
    """ValueError naming ``--ep`` and the fix where the model has no expert stacks, or where ep does not
    divide its experts (``experts.check_ep``)."""
    if args.ep is None:
        return
    if moe is None:
        raise ValueError(
            f"--ep {args.ep}: the model has no expert stacks (or its MoE layers differ); --ep goes with an "
            "MoE preset (deepseek-v3, kimi-k2) or a config.json with experts"
        )
    check_ep(moe, config, args.ep, args.gpus, args.hsdp)


def priced_by(args: Any, moe: MoEModel | None) -> str:
    """How ``launch_step`` priced the step, in words."""
    if moe is not None and args.hsdp == 1:
        return "experts.moe_predict, dense then expert groups" + (
            f" over ep {args.ep}" if getattr(args, "ep", None) else ""
        )
    return f"costmodel.predict, Shard(0) over {args.gpus // args.hsdp} ranks per replica"


def _split_ms(args: Any, found: Check, moe: MoEModel | None) -> float:
    """The modelled step with ``ns_split="auto"`` for the checked model and layout."""
    return launch_step(args, found.shapes, split=True, moe=moe).total * 1e3


def _suggestion(args: Any, found: Check, moe: MoEModel | None) -> list[str]:
    """The modelled step with ns_split="auto" when asked for, or a suggestion when owners are unbalanced."""
    if args.ns_split != "auto" and found.imbalance <= IMBALANCE_HINT:
        return []
    split_ms = _split_ms(args, found, moe)
    step_ms = launch_step(args, found.shapes, split=False, moe=moe).total * 1e3
    change = f"{step_ms:.1f} ms -> {split_ms:.1f} ms"
    if args.ns_split == "auto":
        return [f'with ns_split="auto" (--ns-split auto): modelled step {change}']
    unbalanced = (
        f"owners are unbalanced (the busiest rank's Newton-Schulz is {found.imbalance:.2f} x the mean, "
        f"above {IMBALANCE_HINT})"
    )
    if split_ms < step_ms:
        return [
            f'suggestion: {unbalanced}: Muon(ns_split="auto") runs the largest matrices over a few ranks; '
            f"modelled step {change} (add --ns-split auto to check it)"
        ]
    return [
        f'note: {unbalanced}, but ns_split="auto" would not shorten the modelled step '
        f"({step_ms:.1f} ms): the matrices are too few or too small to pay for splitting"
    ]


def report(args: Any, config: Mapping[str, Any], found: Check, moe: MoEModel | None = None) -> str:
    """The check as text: the model, the layout, the owners' balance, per-rank bytes, the step."""
    shard = args.gpus // (args.hsdp * args.tp)
    counts = [
        [sum(o == r for rnd in plan.rounds for o in rnd.owners) for r in range(plan.group_size)]
        for plan in found.plans
    ]
    balance = "; ".join(
        f"{p.group_size} ranks: {p.imbalance:.3f}, {min(c)}-{max(c)} matrices per rank"
        for p, c in zip(found.plans, counts)
    )
    head_dim, source = _head_dim(args, config)
    qkv = (
        f"per head of {head_dim} rows ({source}; --head-dim 0: whole matrices)"
        if head_dim
        else "whole matrices"
    )
    return "\n".join(
        [
            f"model: {args.check}: {config['num_hidden_layers']} layers of width {config['hidden_size']}; "
            f"Muon: {found.matrices:,} matrices, {found.muon_elements:,} elements; "
            f"AdamW: {found.adamw_elements:,} elements; Muon's q, k, v: {qkv}",
            f"layout: {args.gpus} GPUs = {args.hsdp} replica group(s) x {shard} shards x {args.tp} TP ranks"
            + (
                f" x EP {args.ep} for the experts (gpus / ep = {args.gpus // args.ep} ranks each)"
                if args.ep
                else ""
            )
            + f"; owners {found.owners}",
            f"owner balance (busiest rank's Newton-Schulz flops / mean) per exchange group: {balance}",
            "",
            "| per rank | min | max |",
            "|---|---:|---:|",
            f"| momentum (fp32) | {_span(found.momentum)} |",
            f"| AdamW moments and steps | {_span(found.adamw)} |",
            f"| peak transient of a step (bf16 exchange, CUDA batches) | {_span(found.peak)} |",
            "",
            f"modelled step (the launch's, as plan --rehearse prints it: {priced_by(args, moe)}, the check on "
            f"{hardware(args).check_backend}): {found.step_ms:.1f} ms",
            *_suggestion(args, found, moe),
            "OK: every Muon parameter has a layout the optimizer runs",
        ]
    )


def _span(values: Sequence[int]) -> str:
    return f"{format_bytes(min(values))} | {format_bytes(max(values))}"


def _refuse(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def run_check(args: Any) -> int:
    """Print the check for parsed arguments; return 0, 1 when a layout cannot run (the error names the
    parameter), or 2 for a config that cannot be checked (refused before anything is built)."""
    try:
        config = load_config(args.check)
    except ValueError as e:
        return _refuse(f"--check {e}", 2)
    try:
        validate_config(config)
        head_dim, _ = _head_dim(args, config)
        matrices = muon_matrices(config, head_dim)
    except ValueError as e:
        return _refuse(f"--check {args.check!r}: {e}", 2)
    if matrices * args.gpus > LONG_CHECK:
        print(f"laying out {matrices:,} matrices on {args.gpus:,} ranks: this takes minutes", file=sys.stderr)
    model = meta_model(config)
    try:
        moe = moe_model(model, head_dim)  # split_params: a head_dim that cuts no matrix is a layout error
    except ValueError as e:
        return _refuse(str(e), 1)
    try:
        check_launch_ep(args, moe, args.check)
    except ValueError as e:
        return _refuse(f"--check {args.check!r}: {e}", 2)
    try:
        found = check(
            model, args.gpus, hsdp=args.hsdp, tp=args.tp, owners=args.owners,
            max_round_bytes=args.max_round_bytes or None, head_dim=head_dim, hw=hardware(args), ep=args.ep,
        )  # fmt: skip
    except ValueError as e:
        return _refuse(str(e), 1)
    found = replace(found, step_ms=launch_step(args, found.shapes, moe=moe).total * 1e3)  # the flags' model
    print(report(args, config, found, moe))
    return 0
