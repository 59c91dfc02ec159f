"""``python -m muon_dtensor plan --check CONFIG --gpus N [--hsdp R] [--tp T]``: a topology check before
launch, with no processes and no GPU.

It builds the model's parameters on the meta device from a Hugging Face ``config.json`` (or a
preset), splits them as ``split_params`` does, lays every Muon matrix out as FSDP2 (x TP, x HSDP)
would on N ranks (blocks from placements, ``sharding.plan.blocks``), cuts the matrices
(``views.matrix_views``) and builds the plans (``plan.build_plan``) the optimizer would build. It
prints per-rank memory (``sharding.plan.memory``), the owners' balance and the cost model's step, and
exits 1 naming the parameter and the fix when a layout cannot run (2: bad arguments).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..optim.param_groups import split_params
from ..planning.costmodel import predict
from ..planning.hardware import Hardware
from ..sharding.plan.blocks import AxisShard, Block, block_numel, mesh_blocks, shard_blocks
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, build_plan
from ..sharding.plan.memory import group_peak
from ..sharding.plan.views import View, matrix_views

__all__ = ["PRESETS", "Check", "check", "load_config", "main", "meta_model", "parse_args", "report"]

# Hugging Face config.json fields of the Llama 3 presets (Meta's params.json, as in planning.shapes).
_LLAMA = {"vocab_size": 128256, "num_key_value_heads": 8, "tie_word_embeddings": False}
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3-70b": _LLAMA | {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "llama3.1-405b": _LLAMA | {"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128},
}  # fmt: skip
_COLWISE = frozenset(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))  # TP Shard(0)
_ROWWISE = frozenset(("o_proj", "down_proj"))  # TP Shard(1)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def load_config(source: str) -> dict[str, Any]:
    """A preset's fields, or a ``config.json`` read as data (a multimodal one's ``text_config``)."""
    if source in PRESETS:
        return dict(PRESETS[source])
    path = Path(source)
    if not path.is_file():
        raise ValueError(
            f"--check {source!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    config = json.loads(path.read_text())
    return dict(config.get("text_config", config))


def _need(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config field {key!r} must be a positive integer but is {value!r}")
    return value


class _Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, heads = _need(config, "hidden_size"), _need(config, "num_attention_heads")
        head_dim = config.get("head_dim") or hidden // heads
        kv = (config.get("num_key_value_heads") or heads) * head_dim
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(hidden, heads * head_dim, bias=False),
                "k_proj": nn.Linear(hidden, kv, bias=False),
                "v_proj": nn.Linear(hidden, kv, bias=False),
                "o_proj": nn.Linear(heads * head_dim, hidden, bias=False),
            }
        )
        experts = next((config[k] for k in _EXPERT_KEYS if config.get(k)), 0)
        ffn = config.get("moe_intermediate_size") or _need(config, "intermediate_size")
        self.mlp: nn.Module
        if experts:  # a router and stacks of experts ([E, out, in], as torchtitan's grouped experts)
            self.mlp = nn.ParameterDict(
                {
                    "gate_up_experts": nn.Parameter(torch.empty(experts, 2 * ffn, hidden)),
                    "down_experts": nn.Parameter(torch.empty(experts, hidden, ffn)),
                }
            )
            self.router = nn.Linear(hidden, experts, bias=False)
        else:
            self.mlp = nn.ModuleDict(
                {
                    "gate_proj": nn.Linear(hidden, ffn, bias=False),
                    "up_proj": nn.Linear(hidden, ffn, bias=False),
                    "down_proj": nn.Linear(ffn, hidden, bias=False),
                }
            )
        self.input_layernorm = nn.RMSNorm(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)


def meta_model(config: Mapping[str, Any]) -> nn.Module:
    """A decoder with the config's parameter names and shapes (Hugging Face Llama's), on meta."""
    with torch.device("meta"):
        model = nn.Module()
        model.embed_tokens = nn.Embedding(_need(config, "vocab_size"), _need(config, "hidden_size"))
        model.layers = nn.ModuleList(_Layer(config) for _ in range(_need(config, "num_hidden_layers")))
        model.norm = nn.RMSNorm(config["hidden_size"])
        if not config.get("tie_word_embeddings", False):
            model.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
    return model


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
    groups = split_params(model, muon=["*_experts"], head_dim=head_dim)  # stacks: "experts": True
    muon = [(n, p) for g in groups if g["algorithm"] == "muon" for n, p in g["params"]]
    heads = {n for g in groups if g.get("head_dim") for n, _ in g["params"]}
    adamw = [(n, p) for g in groups if g["algorithm"] == "adamw" for n, p in g["params"]]
    shapes = [view.shape for _, p in muon for view in _views(p.shape, "", None, 2)]
    hw = Hardware.h200()
    pred = predict(shapes, sizes[1] * tp, hw, replicas=hsdp, owners=owners)
    domains: dict[tuple[int, ...], list[tuple[int, View, tuple[int, ...] | None]]] = {}
    params: list[tuple[tuple[int, ...], tuple[Block, ...], bool]] = []
    for pos, (name, p) in enumerate(muon):
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        axes, blocks, replica_of = _layout(
            tuple(p.shape), _shards(p.shape, module, sizes), sizes, pred.owners == "mesh"
        )
        views = _views(tuple(p.shape), name, head_dim if name in heads else None, len(blocks), blocks)
        params.append((axes, blocks, len(views) > 1 or p.ndim != 2))
        domains.setdefault(axes, []).extend((pos, v, replica_of) for v in views)
    plans = {
        axes: build_plan(
            [MatrixEntry(v.shape, v.blocks, _replicated(v), r) for _, v, r in members],
            len(members[0][1].blocks),
            max_round_bytes=max_round_bytes,
        )
        for axes, members in domains.items()
    }
    momentum, peak, moments = [], [], []
    for rank in range(gpus):
        mine = [block_numel(b[_group_rank(rank, axes, sizes)]) for axes, b, _ in params]
        momentum.append(4 * sum(mine))
        moments.append(sum(8 * _dp_numel(p.shape, rank, sizes) + 4 for _, p in adamw))
        where = [
            (plans[axes], _group_rank(rank, axes, sizes), [pos for pos, _, _ in members])
            for axes, members in domains.items()
        ]
        assembled = [a for _, _, a in params]
        peak.append(group_peak(mine, assembled, where, param_item=4, ns_item=2, nesterov=True, cpu=False))
    return Check(
        len(shapes),
        sum(p.numel() for _, p in muon),
        sum(p.numel() for _, p in adamw),
        tuple(plans.values()),
        tuple(momentum),
        tuple(moments),
        tuple(peak),
        pred.total * 1e3,
        pred.owners,
    )


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
    p = argparse.ArgumentParser(
        prog="python -m muon_dtensor plan --check",
        description="Check a model's Muon layouts on N GPUs before launch (meta tensors, no processes).",
    )
    p.add_argument(
        "--check", required=True, metavar="CONFIG", help=f"config.json or a preset ({', '.join(PRESETS)})"
    )
    p.add_argument("--gpus", type=int, required=True, help="ranks in all")
    p.add_argument("--hsdp", type=int, default=1, help="replica groups (HSDP); default 1")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; default 1")
    p.add_argument("--owners", choices=("auto", "mesh", "replica"), default="auto", help="as Muon's (auto)")
    p.add_argument("--max-round-bytes", type=int, default=DEFAULT_ROUND_BYTES, help="as Muon's; 0: one round")
    p.add_argument("--head-dim", type=int, help="per-head q, k, v groups, as split_params(head_dim=...)")
    args = p.parse_args(list(argv))
    if min(args.gpus, args.hsdp, args.tp) < 1 or args.gpus % (args.hsdp * args.tp):
        p.error(f"--gpus {args.gpus} must be a positive multiple of --hsdp {args.hsdp} x --tp {args.tp}")
    return args


def _mb(values: Sequence[int]) -> str:
    return f"{min(values) / 2**20:,.1f} | {max(values) / 2**20:,.1f}"


def report(args: argparse.Namespace, config: Mapping[str, Any], found: Check) -> str:
    shard = args.gpus // (args.hsdp * args.tp)
    counts = [
        [sum(o == r for rnd in plan.rounds for o in rnd.owners) for r in range(plan.group_size)]
        for plan in found.plans
    ]
    balance = "; ".join(
        f"{p.group_size} ranks: {p.imbalance:.3f}, {min(c)}-{max(c)} matrices per rank"
        for p, c in zip(found.plans, counts)
    )
    return "\n".join(
        [
            f"model: {args.check}: {config['num_hidden_layers']} layers of width {config['hidden_size']}; "
            f"Muon: {found.matrices:,} matrices, {found.muon_elements:,} elements; AdamW: {found.adamw_elements:,} elements",
            f"layout: {args.gpus} GPUs = {args.hsdp} replica group(s) x {shard} shards x {args.tp} TP ranks; "
            f"owners {found.owners}",
            f"owner balance (busiest rank's Newton-Schulz flops / mean) per exchange group: {balance}",
            "",
            "| per rank (MiB) | min | max |",
            "|---|---:|---:|",
            f"| momentum (fp32) | {_mb(found.momentum)} |",
            f"| AdamW moments and steps | {_mb(found.adamw)} |",
            f"| peak transient of a step (bf16 exchange, CUDA batches) | {_mb(found.peak)} |",
            "",
            f"modelled step (costmodel.predict, H200, Shard(0) over {shard * args.tp} ranks per replica): "
            f"{found.step_ms:.1f} ms",
            "OK: every Muon parameter has a layout the optimizer runs",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the check; return 0, 1 when a layout cannot run (the error names the parameter), or
    2 for bad arguments."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        config = load_config(args.check)
        found = check(
            meta_model(config),
            args.gpus,
            hsdp=args.hsdp,
            tp=args.tp,
            owners=args.owners,
            max_round_bytes=args.max_round_bytes or None,
            head_dim=args.head_dim,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(report(args, config, found))
    return 0
