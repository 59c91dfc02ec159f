"""``python -m muon_dtensor plan --check CONFIG --gpus N [--hsdp R] [--tp T]``: the check before launch,
with no processes and no GPU (its report: ``check_report``).

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

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..optim.param_groups import split_params
from ..planning.costmodel import CURRENT, Prediction, predict
from ..planning.experts import ExpertLayout, moe_predict
from ..planning.hardware import Hardware
from ..planning.shapes import MoEModel
from ..sharding.plan.blocks import AxisShard, Block, block_numel, mesh_blocks, shard_blocks
from ..sharding.plan.build import DEFAULT_ROUND_BYTES, MatrixEntry, Plan, build_plan
from ..sharding.plan.memory import group_peak
from ..sharding.plan.views import View, matrix_views
from .configs import PRESETS, load_config, meta_model

__all__ = [
    "PRESETS",
    "Check",
    "Laid",
    "check",
    "lay_out",
    "load_config",
    "meta_model",
    "modelled_step",
    "moe_model",
]

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


def _shards(
    shape: Sequence[int], module: str, sizes: tuple[int, int, int], ep: int | None = None
) -> tuple[AxisShard, ...]:
    """FSDP2's Shard(0) on the shard axis, over TP's Shard(0) (colwise: _StridedShard) or Shard(1)
    (rowwise) on the TP axis; experts and other matrices are replicated over TP. With ``ep`` (no TP),
    an expert stack is torchtitan's: rows Shard(1) over the shard / ep ranks of ``dp_shard_mod_ep``
    and experts Shard(0) over ep, the ep ranks consecutive (axis 2 stands for the ep factor of the
    shard axis: group rank f * ep + c is global rank f * ep + c)."""
    _, shard, tp = sizes
    if ep is not None and len(shape) == 3:
        return (AxisShard(1, 1, shard // ep), AxisShard(2, 0, ep))
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


def modelled_step(
    shapes: Sequence[tuple[int, int]],
    gpus: int,
    *,
    hsdp: int = 1,
    hw: Hardware | None = None,
    owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
    ns_steps: int = 5,
    ns_algorithm: str = "standard",
    split: bool = False,
    moe: MoEModel | None = None,
    ep: int | None = None,
) -> Prediction:
    """The one modelled step of a launch, which ``plan --check`` and ``plan --rehearse`` both print:
    ``costmodel.predict`` of the Muon matrices over ``gpus / hsdp`` ranks per replica group (the TP
    placement is not priced), on ``hw`` (default ``Hardware.h200()``). An MoE model (``moe_model``)
    without replicas: its dense and expert groups (``experts.moe_predict``, with ``ep``)."""
    impl = replace(CURRENT, max_round_bytes=max_round_bytes or None)
    if moe is not None and hsdp == 1:
        return moe_predict(
            moe, ExpertLayout(gpus, ep), hw or Hardware.h200(), impl=impl, ns_steps=ns_steps,
            ns_algorithm=ns_algorithm, split=split,
        ).step  # fmt: skip
    return predict(
        list(shapes), gpus // hsdp, hw or Hardware.h200(), impl=impl, ns_steps=ns_steps,
        ns_algorithm=ns_algorithm, replicas=hsdp, owners=owners, split=split,
    )  # fmt: skip


def moe_model(model: nn.Module, head_dim: int | None = None) -> MoEModel | None:
    """The model as the cost model prices a mixture of experts (``planning.experts``): its 2-D Muon
    matrices dense, its ``[E, out, in]`` stacks expert groups; None without stacks, or where the MoE
    layers differ (then every expert is priced as a matrix of its own)."""
    muon, heads, _ = _split(model, head_dim)
    stacks = [(n, tuple(p.shape)) for n, p in muon if p.ndim == 3]
    if not stacks:
        return None
    layers = sorted({n.rsplit(".", 2)[0] for n, _ in stacks})  # "layers.3" of "layers.3.mlp.up_experts"
    per_layer = len(stacks) // len(layers)
    first = tuple((s[1], s[2]) for _, s in stacks[:per_layer])
    experts = stacks[0][1][0]
    if per_layer * len(layers) != len(stacks) or any(s[0] != experts for _, s in stacks):
        return None
    if any(
        tuple((s[1], s[2]) for _, s in stacks[i : i + per_layer]) != first
        for i in range(0, len(stacks), per_layer)
    ):
        return None
    dense = _shapes([(n, p) for n, p in muon if p.ndim == 2], heads)
    return MoEModel("config", tuple(dense), experts, first, len(layers))


def check(
    model: nn.Module,
    gpus: int,
    *,
    hsdp: int = 1,
    tp: int = 1,
    owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES,
    head_dim: int | None = None,
    hw: Hardware | None = None,
    ep: int | None = None,
) -> Check:
    """Lay ``model``'s parameters (meta tensors do) out on ``gpus`` ranks = ``hsdp`` replicas x
    shards x ``tp`` (expert stacks over ``ep`` x gpus / ``ep``), plan them, and price them on ``hw``
    (default ``Hardware.h200()``) with ``modelled_step``; ValueError naming the parameter where one
    cannot run."""
    laid = lay_out(
        model, gpus, hsdp=hsdp, tp=tp, owners=owners, max_round_bytes=max_round_bytes, head_dim=head_dim,
        hw=hw, ep=ep,
    )  # fmt: skip
    figures = [rank_bytes(laid, rank) for rank in range(gpus)]
    momentum, moments, peak = (tuple(f[i] for f in figures) for i in range(3))
    return Check(
        len(laid.shapes), sum(p.numel() for _, p in laid.muon), sum(_numel(s) for s in laid.adamw),
        tuple(laid.plans.values()), momentum, moments, peak, laid.step.total * 1e3, laid.step.owners,
        tuple(laid.shapes),
    )  # fmt: skip


_Params = list[tuple[tuple[int, ...], tuple[Block, ...], bool]]  # (exchange axes, blocks, assembled)
_Domains = dict[tuple[int, ...], list[tuple[int, View, tuple[int, ...] | None]]]  # axes: (pos, view, replica)
_Key = tuple[tuple[int, ...], int]  # a distinct layout: exchange axes and its blocks' identity


@dataclass(frozen=True)
class Laid:
    """A model laid out on a mesh of ``sizes`` = (replicas, shards, TP): its Muon parameters and
    AdamW shapes, the matrices (``shapes``), the modelled ``step``, each Muon parameter's exchange
    axes and blocks (``params``), the matrices of each exchange group (``domains``) and their plans."""

    sizes: tuple[int, int, int]
    muon: list[tuple[str, nn.Parameter]]
    adamw: list[tuple[int, ...]]
    shapes: list[tuple[int, int]]
    step: Prediction
    params: _Params
    domains: _Domains
    plans: dict[tuple[int, ...], Plan]

    @functools.cached_property
    def groups(
        self,
    ) -> tuple[dict[_Key, Any], list[_Key], dict[tuple[int, ...], int], dict[tuple[int, ...], list[int]]]:
        """Distinct layouts, each parameter's, AdamW shapes with their counts, and each exchange group's
        parameter positions: what ``rank_bytes`` reads per rank."""
        layouts = {(axes, id(blocks)): (axes, blocks) for axes, blocks, _ in self.params}
        which = [(axes, id(blocks)) for axes, blocks, _ in self.params]
        dp_shapes: dict[tuple[int, ...], int] = {}
        for shape in self.adamw:
            dp_shapes[shape] = dp_shapes.get(shape, 0) + 1
        positions = {axes: [pos for pos, _, _ in members] for axes, members in self.domains.items()}
        return layouts, which, dp_shapes, positions

    def group_rank(self, rank: int, axes: tuple[int, ...]) -> int:
        """``rank``'s rank in its exchange group over ``axes``."""
        return _group_rank(rank, axes, self.sizes)


def lay_out(
    model: nn.Module, gpus: int, *, hsdp: int = 1, tp: int = 1, owners: str = "auto",
    max_round_bytes: int | None = DEFAULT_ROUND_BYTES, head_dim: int | None = None, hw: Hardware | None = None,
    ep: int | None = None,
) -> Laid:  # fmt: skip
    """``check``'s layouts and plans, with no per-rank figure (pure; what the optimizer's first step
    builds); ValueError naming the parameter where one cannot run."""
    if gpus < 1 or hsdp < 1 or tp < 1 or gpus % (hsdp * tp):
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --hsdp {hsdp} x --tp {tp}")
    if ep is not None and (hsdp > 1 or tp > 1 or gpus % ep):
        raise ValueError(
            f"--ep {ep} lays experts out over ep x gpus / ep: it must divide --gpus {gpus}, with no --hsdp "
            f"or --tp (given {hsdp} and {tp})"
        )
    sizes = (hsdp, gpus // (hsdp * tp), tp)
    muon, heads, adamw = _split(model, head_dim)
    shapes = _shapes(muon, heads)
    step = modelled_step(shapes, gpus, hsdp=hsdp, hw=hw, owners=owners, max_round_bytes=max_round_bytes)
    params, domains = _lay_out(muon, heads, sizes, step.owners == "mesh", ep)
    plans = {
        axes: build_plan(
            [MatrixEntry(v.shape, v.blocks, _replicated(v), r) for _, v, r in members],
            len(members[0][1].blocks),
            max_round_bytes=max_round_bytes,
        )
        for axes, members in domains.items()
    }
    return Laid(sizes, muon, adamw, shapes, step, params, domains, plans)


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


def _lay_out(
    muon: list[tuple[str, nn.Parameter]],
    heads: Mapping[str, int],
    sizes: tuple[int, int, int],
    mesh: bool,
    ep: int | None = None,
) -> tuple[_Params, _Domains]:
    """Each Muon parameter's exchange axes, blocks and whether its update is assembled from several
    matrices; and per exchange group (axes) its matrices, as (parameter position, view, replicas)."""
    params: _Params = []
    domains: _Domains = {}
    for pos, (name, p) in enumerate(muon):
        module = name.rsplit(".", 2)[-2] if "." in name else ""
        axes, blocks, replica_of = _layout(tuple(p.shape), _shards(p.shape, module, sizes, ep), sizes, mesh)
        views = _views(tuple(p.shape), name, heads.get(name), len(blocks), blocks)
        params.append((axes, blocks, len(views) > 1 or p.ndim != 2))
        domains.setdefault(axes, []).extend((pos, v, replica_of) for v in views)
    return params, domains


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def rank_bytes(laid: Laid, rank: int) -> tuple[int, int, int]:
    """``rank``'s momentum, AdamW moments and step counters, and peak transient bytes. Parameters laid
    out alike (every layer's) share their blocks: each layout's numel is read once per rank."""
    layouts, which, dp_shapes, positions = laid.groups
    numel = {k: block_numel(b[laid.group_rank(rank, axes)]) for k, (axes, b) in layouts.items()}
    mine = [numel[k] for k in which]
    shard_rank = rank // laid.sizes[2] % laid.sizes[1]
    moments = sum(
        n * (8 * _dp_numels(s, laid.sizes[1])[shard_rank] + 4 if s else 12) for s, n in dp_shapes.items()
    )
    where = [(laid.plans[axes], laid.group_rank(rank, axes), pos) for axes, pos in positions.items()]
    assembled = [a for _, _, a in laid.params]
    peak = group_peak(mine, assembled, where, param_item=4, ns_item=2, nesterov=True, cpu=False)
    return 4 * sum(mine), moments, peak


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


@functools.lru_cache(maxsize=256)
def _dp_numels(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    return tuple(block_numel(b) for b in shard_blocks(shape, [AxisShard(1, 0, shard)]))
