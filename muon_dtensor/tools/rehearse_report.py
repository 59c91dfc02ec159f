"""``plan --rehearse``'s run and report: the checks before anything is built (the config, a modelled
set-up time within ``MAX_SETUP_S``, a memory bound within ``MAX_LOCAL_BYTES``), the rank to play
(``--rank``, or ``--busiest`` from the plans), an estimate before a real Newton-Schulz and progress
while it runs (stderr), then what ``rehearse.rehearse`` measured beside the cost model's figures:
the CPU's own figures in one column, the model's (an H200 step) in another. Every refusal is an
``error:`` line and exit 2."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..planning.inputs import format_bytes
from ..planning.shapes import MoEModel
from .busiest import busiest
from .check_report import check_launch_ep, launch_step, priced_by
from .configs import load_config, meta_model, muon_matrices, validate_config
from .launch_check import LONG_CHECK, Laid, lay_out, moe_model
from .plan_flags import hardware
from .rehearse import MAX_PROFILED_OPS, Rehearsal, rehearse

__all__ = ["MAX_LOCAL_BYTES", "MAX_SETUP_S", "modelled_setup_s", "report", "run_rehearsal"]

# Bytes a rehearsal may peak at (``rehearse.memory_bound``): a rank of a small world holds most of a
# large model.
MAX_LOCAL_BYTES = 16 << 30
# CPU seconds of the first step's set-up (``modelled_setup_s``) above which a rehearsal is refused.
MAX_SETUP_S = 600.0
# The first step's set-up on one CPU core: per Muon matrix, and per matrix and rank of its exchange
# group (the plans give every rank a block of every matrix). Fitted to rehearsals measured here
# (docs/scale.md, "Rehearse your own layout"); the fit is held by tests/tools/test_rehearse.py.
SETUP_PER_MATRIX_S = 0.4e-3
SETUP_PER_BLOCK_S = 0.35e-6


def modelled_setup_s(matrices: int, group_ranks: int) -> float:
    """CPU seconds of the optimizer's first-step set-up for ``matrices`` Muon matrices over exchange
    groups of ``group_ranks`` ranks (the plans' blocks dominate at scale)."""
    return matrices * (SETUP_PER_MATRIX_S + SETUP_PER_BLOCK_S * group_ranks)


def _say(line: str) -> None:
    print(f"rehearse [{time.process_time():,.1f} s of CPU]: {line}", file=sys.stderr, flush=True)


def _cpu_flops() -> float:
    """This core's bfloat16 matmul rate (Newton-Schulz's dtype), from a few 512 x 512 products."""
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    torch.mm(a, a)
    start, reps = time.process_time(), 4
    for _ in range(reps):
        torch.mm(a, a)
    return reps * 2 * 512**3 / max(time.process_time() - start, 1e-6)


def _plans(args: Any, config: Mapping[str, Any], head_dim: int | None, matrices: int) -> Laid | None:
    """The plans before launch, when they are cheap (``LONG_CHECK``) or asked for (``--busiest``)."""
    if matrices * args.gpus > LONG_CHECK and not args.busiest:
        return None
    return lay_out(
        meta_model(config), args.gpus, hsdp=args.hsdp, tp=args.tp, owners=args.owners,
        max_round_bytes=args.max_round_bytes or None, head_dim=head_dim, hw=hardware(args), ep=args.ep,
    )  # fmt: skip


def _preflight(args: Any) -> tuple[dict[str, Any], int | None, str, MoEModel | None]:
    """The config, rows per head, why this rank, and the model as MoE pricing sees it: every check
    that needs no shard."""
    config = load_config(args.rehearse)
    validate_config(config)
    head_dim = (args.head_dim if args.head_dim is not None else config.get("head_dim")) or None
    matrices = muon_matrices(config, head_dim)
    setup = modelled_setup_s(matrices, args.gpus // args.hsdp)
    if setup > MAX_SETUP_S:
        raise ValueError(
            f"the first step's set-up is modelled at {setup:,.0f} s of CPU for {matrices:,} matrices over "
            f"{args.gpus // args.hsdp:,} ranks, above {MAX_SETUP_S:,.0f} s: plan --check prices this layout "
            "without running it, or rehearse fewer ranks or layers"
        )
    moe = moe_model(meta_model(config), head_dim)
    check_launch_ep(args, moe, args.rehearse)
    _say(
        f"{matrices:,} Muon matrices on {args.gpus:,} ranks; first step's set-up modelled at {setup:,.1f} s of CPU"
    )
    laid = _plans(args, config, head_dim, matrices)
    why = f"rank {args.rank} (--rank)"
    if args.busiest:
        assert laid is not None
        chosen = busiest(laid, args.gpus, hardware(args), args.ns_steps)
        args.rank, why = chosen.rank, chosen.why()
        _say(why)
    if not args.skip_ns:
        _ns_estimate(args, laid)
    return config, head_dim, why, moe


def _ns_estimate(args: Any, laid: Laid | None) -> None:
    if laid is None:
        _say(
            "Newton-Schulz runs for real (no estimate at this size: --skip-ns leaves it out); progress follows"
        )
        return
    per_step = (
        sum(p.loads[laid.group_rank(args.rank, axes)] for axes, p in laid.plans.items()) * args.ns_steps
    )
    runs = 2 + args.steps  # the first step, the steady ones and the profiled one
    seconds = per_step * runs / _cpu_flops()
    _say(
        f"Newton-Schulz runs for real on rank {args.rank}'s matrices: {per_step / 1e9:,.1f} GFLOP per step x "
        f"{runs} steps, about {seconds:,.0f} s of CPU at this core's bfloat16 rate (--skip-ns leaves it out)"
    )


def _ns_options(args: Any) -> dict[str, Any]:
    """The Newton-Schulz flags as ``Muon``'s options: the real step runs what the model prices."""
    return {"ns_steps": args.ns_steps, "ns_algorithm": args.ns_algorithm, "ns_split": args.ns_split}


def run_rehearsal(args: Any) -> int:
    """Rehearse for parsed arguments and print the report; 0, or 2 with an ``error:`` line."""
    try:
        config, head_dim, why, moe = _preflight(args)
        found = rehearse(
            config, args.gpus, args.rank, hsdp=args.hsdp, tp=args.tp, skip_ns=args.skip_ns, steps=args.steps,
            head_dim=head_dim, owners=args.owners, max_round_bytes=args.max_round_bytes or None, ep=args.ep,
            hw=hardware(args), max_bytes=MAX_LOCAL_BYTES, progress=_say, muon_options=_ns_options(args),
        )  # fmt: skip
    except ValueError as e:
        print(f"error: --rehearse {args.rehearse!r}: {e}", file=sys.stderr)
        return 2
    print(report(args, found, why, moe))
    return 0


def _counted(n: int) -> str:
    return f"{n:,}" if n >= 0 else f"not profiled (above {MAX_PROFILED_OPS:,} modelled ops)"


def _memory_model(r: Rehearsal) -> str:
    if r.modelled_memory is None:
        return "plan --check (TP, EP, or above 1,024 ranks)"
    return f"{format_bytes(r.modelled_memory[0])} / {format_bytes(r.modelled_memory[1])}"


def report(args: Any, r: Rehearsal, why: str = "", moe: MoEModel | None = None) -> str:
    """The rehearsal as text: this CPU's measured figures in one column, the cost model's in another."""
    shard = args.gpus // (args.hsdp * args.tp)
    p = launch_step(
        args, r.shapes, moe=moe
    )  # the one modelled step of this launch, as plan --check prints it
    ns = (
        f"Newton-Schulz skipped (--skip-ns) on the {r.owned} matrices this rank owns: the host times leave it out"
        if r.skipped_ns
        else f"Newton-Schulz run for real on the {r.owned} matrices this rank owns (CPU; --skip-ns leaves it out)"
    )
    counts: dict[str, list[int]] = {}
    for name, nbytes in r.collectives:
        counts.setdefault(name, []).append(nbytes)
    listed = "; ".join(
        f"{n} x{len(b)}: {', '.join(format_bytes(x) for x in b[:6])}{' ...' if len(b) > 6 else ''}"
        for n, b in counts.items()
    )
    mem, ep = r.memory, f" x EP {args.ep} for the experts" if args.ep else ""
    setup = modelled_setup_s(r.matrices, args.gpus // args.hsdp)
    return "\n".join(
        [
            f"rehearsal: {args.rehearse} on {args.gpus:,} ranks = {args.hsdp} replica group(s) x {shard:,} "
            f"shards x {args.tp} TP{ep}, rank {args.rank}, fake backend (one process; collectives move nothing)",
            *([f"why this rank: {why}"] if args.busiest else []),
            f"Muon matrices: {r.matrices:,}; this rank's shard elements: {r.local_elements:,}; {ns}",
            "",
            f"| per step, this rank | measured on this CPU | modelled (H200, the check on {hardware(args).check_backend}) |",
            "|---|---:|---:|",
            f"| first step, set-up and step (CPU time) | {r.setup_s:.2f} s | - |",
            f"| its set-up: first step - steady step (CPU time) | {max(r.setup_s - r.steady_s, 0):.2f} s "
            f"| {setup:.2f} s (CPU model, modelled_setup_s) |",
            f"| steady step's host time (CPU time, fp32 on one core) | {r.steady_s * 1e3:.1f} ms | - |",
            f"| GPU host time (eager ops) of the modelled step | - | {p.host * 1e3:.2f} ms |",
            f"| modelled step (the launch's, as plan --check prints it: {priced_by(args, moe)}) | - | {p.total * 1e3:.1f} ms |",
            f"| host ops (top-level aten) | {_counted(r.host_ops)} | {r.predicted_ops:,} (host_ops.step_ops) |",
            f"| collectives | {_counted(len(r.collectives) if r.host_ops >= 0 else -1)} | {p.collectives} |",
            f"| bytes sent / received to other ranks | {format_bytes(r.sent)} / {format_bytes(r.received)} "
            f"| {format_bytes(r.modelled_bytes[0])} / {format_bytes(r.modelled_bytes[1])} (this rank); "
            f"{format_bytes(int(p.bytes_sent_mean))} sent (mean), {format_bytes(int(p.bytes_sent_max))} (max) |",
            f"| momentum / peak transient (Muon.memory) | {format_bytes(mem.get('momentum', 0))} / "
            f"{format_bytes(mem['peak_transient'])} | {_memory_model(r)} |",
            "",
            f"collectives of a steady step (buffer bytes): {listed or 'none'}",
            f"process groups created: {r.groups_mesh} by the meshes, {r.groups_optimizer} by the optimizer",
            *(f"owners: {line}; the cost model's: {p.owners}" for line in r.owners),
        ]
    )
