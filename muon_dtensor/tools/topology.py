"""``python -m muon_dtensor plan --check CONFIG --gpus N [--hsdp R] [--tp T]``: a topology check before
launch, with no processes and no GPU.

It builds the model's parameters on the meta device from a Hugging Face ``config.json`` (or a
preset), splits them as ``split_params`` does, lays every Muon matrix out as FSDP2 (x TP, x HSDP)
would on N ranks (blocks from placements, ``sharding.plan.blocks``), cuts the matrices
(``views.matrix_views``) and builds the plans (``plan.build_plan``) the optimizer would build. It
prints per-rank memory (``sharding.plan.memory``), the owners' balance and the cost model's step
(with ``ns_split="auto"`` too when asked for, or suggested when the owners are unbalanced), and exits
1 naming the parameter and the fix when a layout cannot run; 2 for bad arguments or a config it
cannot check (unreadable, not an object, a field out of range: ``tools.configs``), refused before
anything is built.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..optim.param_groups import split_params
from ..planning.cli import check_options, owner_options
from ..planning.costmodel import predict
from ..planning.hardware import Hardware
from ..planning.inputs import GPUS, format_bytes
from ..sharding.plan.blocks import AxisShard, Block, block_numel, mesh_blocks, shard_blocks
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, build_plan
from ..sharding.plan.memory import group_peak
from ..sharding.plan.views import View, matrix_views
from .configs import PRESETS, load_config, meta_model, muon_matrices, validate_config

__all__ = ["PRESETS", "Check", "check", "load_config", "main", "meta_model", "parse_args", "report"]

_COLWISE = frozenset(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))  # TP Shard(0)
_ROWWISE = frozenset(("o_proj", "down_proj"))  # TP Shard(1)
# Owners this unbalanced (busiest rank's Newton-Schulz flops / mean) leave most ranks waiting on one:
# the report prices ns_split="auto", which runs the largest matrices over a few ranks.
IMBALANCE_HINT = 1.5
# Matrices x ranks above which the check says it takes a while (tens of microseconds each on a CPU
# core: Llama-3-8B's 224 matrices on 1,024 ranks take seconds, this many a few minutes).
LONG_CHECK = 1 << 22


@dataclass(frozen=True)
class Check:
    """What ``check`` found: Muon matrices, the plans per exchange group, per-rank bytes
    (momentum, AdamW moments and counters, peak transient) and the cost model's step."""

    matrices: int
    muon_elements: int
    adamw_elements: int
    plans: tuple[Plan, ...]
    momentum: tuple[int, ...]
    adamw: tuple[int, ...]
    peak: tuple[int, ...]
    step_ms: float
    owners: str
    shapes: tuple[Any, ...] = ()  # the cost model's input, for the ns_split="auto" variant

    @property
    def imbalance(self) -> float:
        """The most unbalanced exchange group's busiest rank over its mean (1.0: even)."""
        return max((p.imbalance for p in self.plans), default=1.0)


def _shards(shape: Sequence[int], module: str, sizes: tuple[int, int, int]) -> tuple[AxisShard, ...]:
    """FSDP2's Shard(0) on the shard axis, over TP's Shard(0) (colwise: _StridedShard) or Shard(1)
    (rowwise) on the TP axis; experts and other matrices are replicated over TP."""
    _, shard, tp = sizes
    tp_dim = 0 if module in _COLWISE else 1 if module in _ROWWISE else None
    tp_dim = None if len(shape) != 2 or tp == 1 else tp_dim
    out = [AxisShard(1, 0, shard, tp if tp_dim == 0 else 1)] if shard > 1 else []
    return tuple(out + ([AxisShard(2, tp_dim, tp)] if tp_dim is not None else []))


@functools.lru_cache(maxsize=256)
def _layout(
    shape: tuple[int, ...], shards: tuple[AxisShard, ...], sizes: tuple[int, int, int], mesh: bool
) -> tuple[tuple[int, ...], tuple[Block, ...], tuple[int, ...] | None]:
    """(exchange axes, a block per group rank, replica per group rank or None) of one parameter."""
    axes = tuple(s.axis for s in shards) or (0, 1, 2)
    if mesh or not shards:  # owners over the whole mesh, or a parameter replicated everywhere
        blocks, replica_of = mesh_blocks(shape, sizes, shards)
        return (0, 1, 2), blocks, replica_of if shards else None
    return axes, shard_blocks(shape, shards), None


def _group_rank(rank: int, axes: tuple[int, ...], sizes: tuple[int, int, int]) -> int:
    coords = [rank // (sizes[1] * sizes[2]), rank // sizes[2] % sizes[1], rank % sizes[2]]
    out = 0
    for a in axes:
        out = out * sizes[a] + coords[a]
    return out


def check(
    model: nn.Module,
    gpus: int,
    *,
    hsdp: int = 1,
    tp: int = 1,
    owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
    head_dim: int | None = None,
) -> Check:
    """Lay ``model``'s parameters (meta tensors do) out on ``gpus`` ranks = ``hsdp`` replicas x
    shards x ``tp``, plan them, and price them; ValueError naming the parameter where one cannot run."""
    if gpus < 1 or hsdp < 1 or tp < 1 or gpus % (hsdp * tp):
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --hsdp {hsdp} x --tp {tp}")
    sizes = (hsdp, gpus // (hsdp * tp), tp)
    muon, heads, adamw = _split(model, head_dim)
    shapes = _shapes(muon, heads)
    pred = predict(shapes, sizes[1] * tp, Hardware.h200(), replicas=hsdp, owners=owners)
    params, domains = _lay_out(muon, heads, sizes, pred.owners == "mesh")
    plans = {
        axes: build_plan(
            [MatrixEntry(v.shape, v.blocks, _replicated(v), r) for _, v, r in members],
            len(members[0][1].blocks),
            max_round_bytes=max_round_bytes,
        )
        for axes, members in domains.items()
    }
    momentum, moments, peak = _per_rank(gpus, sizes, params, domains, plans, adamw)
    return Check(
        len(shapes), sum(p.numel() for _, p in muon), sum(_numel(s) for s in adamw), tuple(plans.values()),
        momentum, moments, peak, pred.total * 1e3, pred.owners, tuple(shapes),
    )  # fmt: skip


def _split(
    model: nn.Module, head_dim: int | None
) -> tuple[list[tuple[str, nn.Parameter]], dict[str, int], list[tuple[int, ...]]]:
    """As ``split_params`` splits ``model`` (expert stacks to Muon): the Muon parameters, the rows per
    head of those cut per head, and the AdamW parameters' shapes."""
    groups = split_params(model, muon=["*_experts"], head_dim=head_dim)  # stacks: "experts": True
    muon = [(n, p) for g in groups if g["algorithm"] == "muon" for n, p in g["params"]]
    heads = {n: g["head_dim"] for g in groups if g.get("head_dim") for n, _ in g["params"]}
    adamw = [tuple(p.shape) for g in groups if g["algorithm"] == "adamw" for _, p in g["params"]]
    return muon, heads, adamw


def _shapes(muon: list[tuple[str, nn.Parameter]], heads: Mapping[str, int]) -> list[tuple[int, int]]:
    """The matrices the optimizer orthogonalizes, as the cost model takes them."""
    return [v.shape for n, p in muon for v in _views(tuple(p.shape), "", heads.get(n), 2)]


_Params = list[tuple[tuple[int, ...], tuple[Block, ...], bool]]  # (exchange axes, blocks, assembled)
_Domains = dict[tuple[int, ...], list[tuple[int, View, tuple[int, ...] | None]]]  # axes: (pos, view, replica)


def _lay_out(
    muon: list[tuple[str, nn.Parameter]],
    heads: Mapping[str, int],
    sizes: tuple[int, int, int],
    mesh: bool,
) -> tuple[_Params, _Domains]:
    """Each Muon parameter's exchange axes, blocks and whether its update is assembled from several
    matrices; and per exchange group (axes) its matrices, as (parameter position, view, replicas)."""
    params: _Params = []
    domains: _Domains = {}
    for pos, (name, p) in enumerate(muon):
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        axes, blocks, replica_of = _layout(tuple(p.shape), _shards(p.shape, module, sizes), sizes, mesh)
        views = _views(tuple(p.shape), name, heads.get(name), len(blocks), blocks)
        params.append((axes, blocks, len(views) > 1 or p.ndim != 2))
        domains.setdefault(axes, []).extend((pos, v, replica_of) for v in views)
    return params, domains


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _per_rank(
    gpus: int,
    sizes: tuple[int, int, int],
    params: _Params,
    domains: _Domains,
    plans: Mapping[tuple[int, ...], Plan],
    adamw: list[tuple[int, ...]],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per rank: momentum, AdamW moments and step counters, and peak transient bytes. Parameters laid
    out alike (every layer's) share their blocks: each layout's numel is read once per rank."""
    layouts = {(axes, id(blocks)): (axes, blocks) for axes, blocks, _ in params}
    which = [(axes, id(blocks)) for axes, blocks, _ in params]
    dp_shapes: dict[tuple[int, ...], int] = {}
    for shape in adamw:
        dp_shapes[shape] = dp_shapes.get(shape, 0) + 1
    assembled = [a for _, _, a in params]
    positions = {axes: [pos for pos, _, _ in members] for axes, members in domains.items()}
    momentum, moments, peak = [], [], []
    for rank in range(gpus):
        numel = {k: block_numel(b[_group_rank(rank, axes, sizes)]) for k, (axes, b) in layouts.items()}
        mine = [numel[k] for k in which]
        momentum.append(4 * sum(mine))
        moments.append(sum(n * (8 * _dp_numel(s, rank, sizes) + 4) for s, n in dp_shapes.items()))
        where = [(plans[axes], _group_rank(rank, axes, sizes), pos) for axes, pos in positions.items()]
        peak.append(group_peak(mine, assembled, where, param_item=4, ns_item=2, nesterov=True, cpu=False))
    return tuple(momentum), tuple(moments), tuple(peak)


_VIEWS: dict[tuple, list[View]] = {}


def _views(
    shape: tuple[int, ...], name: str, head_dim: int | None, ranks: int, blocks: tuple[Block, ...] = ()
) -> list[View]:
    """The matrices of a parameter (cached per shape and layout: every layer repeats them)."""
    key = (shape, head_dim, blocks)
    if key not in _VIEWS:
        blocks = blocks or tuple(tuple(((0, s),) for s in shape) for _ in range(ranks))
        _VIEWS[key] = matrix_views(shape, blocks, 0, name=name, experts=len(shape) == 3, head_dim=head_dim)
    return _VIEWS[key]


def _replicated(view: View) -> bool:
    whole = ((0, view.shape[0]),), ((0, view.shape[1]),)
    return len(view.blocks) > 1 and all(b == whole for b in view.blocks)


def _dp_numel(shape: Sequence[int], rank: int, sizes: tuple[int, int, int]) -> int:
    """Elements of an AdamW parameter on ``rank``: FSDP2's Shard(0) over the shard axis."""
    return _dp_numels(tuple(shape), sizes[1])[rank // sizes[2] % sizes[1]] if shape else 1


@functools.lru_cache(maxsize=256)
def _dp_numels(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    return tuple(block_numel(b) for b in shard_blocks(shape, [AxisShard(1, 0, shard)]))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``plan --check``'s arguments; exits with status 2 on bad ones (0 for ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan --check",
        description="Check a model's Muon layouts on N GPUs before launch (meta tensors, no processes): "
        "per-rank memory, the owners' balance and the modelled step; exit 1 when a layout cannot run.",
    )
    p.add_argument(  # an optional value, so that "plan --check --help" prints this help
        "--check", nargs="?", metavar="CONFIG", help=f"config.json or a preset ({', '.join(PRESETS)})"
    )
    p.add_argument("--gpus", type=GPUS, required=True, help="ranks in all")
    check_options(p)
    owner_options(p)
    return parse_layout(p, argv, "check")


def parse_layout(p: argparse.ArgumentParser, argv: Sequence[str], command: str) -> argparse.Namespace:
    """``p``'s arguments with ``--COMMAND CONFIG``, ``--gpus`` and the layout options checked
    (``--hsdp`` and ``--tp`` default to 1); exits with status 2 on bad ones."""
    args = p.parse_args(list(argv))
    if getattr(args, command) is None:
        p.error(f"--{command} needs a CONFIG: a config.json file or a preset ({', '.join(PRESETS)})")
    args.hsdp, args.tp = args.hsdp or 1, args.tp or 1
    if args.gpus % (args.hsdp * args.tp):
        p.error(f"--gpus {args.gpus} must be a positive multiple of --hsdp {args.hsdp} x --tp {args.tp}")
    return args


def _head_dim(args: argparse.Namespace, config: Mapping[str, Any]) -> tuple[int | None, str]:
    """The rows per head q, k, v are cut in (None: whole matrices), and where that came from."""
    if args.head_dim is not None:
        return args.head_dim or None, "--head-dim"
    return config.get("head_dim") or None, "the config's head_dim"


def _split_ms(args: argparse.Namespace, found: Check) -> float:
    """The modelled step with ``ns_split="auto"`` for the checked model and layout."""
    shard, hw = args.gpus // args.hsdp, Hardware.h200()
    return (
        predict(list(found.shapes), shard, hw, replicas=args.hsdp, owners=args.owners, split=True).total * 1e3
    )


def _suggestion(args: argparse.Namespace, config: Mapping[str, Any], found: Check) -> list[str]:
    """The modelled step with ns_split="auto" when asked for, or a suggestion when owners are unbalanced."""
    if args.ns_split != "auto" and found.imbalance <= IMBALANCE_HINT:
        return []
    split_ms = _split_ms(args, found)
    change = f"{found.step_ms:.1f} ms -> {split_ms:.1f} ms"
    if args.ns_split == "auto":
        return [f'with ns_split="auto" (--ns-split auto): modelled step {change}']
    unbalanced = (
        f"owners are unbalanced (the busiest rank's Newton-Schulz is {found.imbalance:.2f} x the mean, "
        f"above {IMBALANCE_HINT})"
    )
    if split_ms < found.step_ms:
        return [
            f'suggestion: {unbalanced}: Muon(ns_split="auto") runs the largest matrices over a few ranks; '
            f"modelled step {change} (add --ns-split auto to check it)"
        ]
    return [
        f'note: {unbalanced}, but ns_split="auto" would not shorten the modelled step '
        f"({found.step_ms:.1f} ms): the matrices are too few or too small to pay for splitting"
    ]


def report(args: argparse.Namespace, config: Mapping[str, Any], found: Check) -> str:
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
            f"layout: {args.gpus} GPUs = {args.hsdp} replica group(s) x {shard} shards x {args.tp} TP ranks; "
            f"owners {found.owners}",
            f"owner balance (busiest rank's Newton-Schulz flops / mean) per exchange group: {balance}",
            "",
            "| per rank | min | max |",
            "|---|---:|---:|",
            f"| momentum (fp32) | {_span(found.momentum)} |",
            f"| AdamW moments and steps | {_span(found.adamw)} |",
            f"| peak transient of a step (bf16 exchange, CUDA batches) | {_span(found.peak)} |",
            "",
            f"modelled step (costmodel.predict, H200, Shard(0) over {shard * args.tp} ranks per replica): "
            f"{found.step_ms:.1f} ms",
            *_suggestion(args, config, found),
            "OK: every Muon parameter has a layout the optimizer runs",
        ]
    )


def _span(values: Sequence[int]) -> str:
    return f"{format_bytes(min(values))} | {format_bytes(max(values))}"


def _refuse(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Print the check; return 0, 1 when a layout cannot run (the error names the parameter), or
    2 for bad arguments or a config that cannot be checked (refused before anything is built)."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
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
    try:
        found = check(
            meta_model(config), args.gpus, hsdp=args.hsdp, tp=args.tp, owners=args.owners,
            max_round_bytes=args.max_round_bytes or None, head_dim=head_dim,
        )  # fmt: skip
    except ValueError as e:
        return _refuse(str(e), 1)
    print(report(args, config, found))
    return 0
