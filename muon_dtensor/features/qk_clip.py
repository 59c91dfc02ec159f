"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534, section 2.1) on plain or sharded q/k weights.

After an optimizer step, a head ``h`` whose largest pre-softmax logit ``s_h`` (``q.k / sqrt(head_dim)``
over the step's batch) exceeds ``threshold`` gets its query rows scaled by ``(threshold / s_h) ** alpha``
and its key rows by ``(threshold / s_h) ** (1 - alpha)``, so its largest logit on that batch becomes
``threshold``. Only the weights change; optimizer state (momentum) does not.

Every rank must scale by the same factors, so ``s_h`` is the MAX over every rank of the weights'
mesh before anything is computed from it (ms-swift's MuonClip applied process-local maxima and its
data-parallel replicas drifted apart until it all-reduced them, modelscope/ms-swift#9901). That one
all-reduce per mesh axis, for every layer of the mesh at once, also carries a digest of the other
arguments and every rank's failures, so ranks that disagree or fail raise the same error together.

Exactness: the factors are computed in float32 on the host from the reduced maxima, identical bits
on every rank; each weight element is then multiplied once by its head's float32 factor (the result
rounded to the weight's dtype), so a shard's rows are the same rows of the one-process result.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..checks.agreement import digest_pieces, plain
from ..sharding.plan.blocks import AxisShard, Interval, shard_blocks
from ..sharding.plan.param_layout import _shards, check_placements, local_of
from ..sharding.runtime import comm

__all__ = ["QKClipFactors", "qk_clip_", "qk_clip_all_", "qk_clip_factors"]

Scope = DeviceMesh | dist.ProcessGroup | None  # a mesh, the default group, or no communication


class QKClipFactors(NamedTuple):
    """What ``qk_clip_`` did, for logging: float32 factors per query head ``[num_heads]`` and per key
    head ``[num_kv_heads]`` (1.0 where nothing was clipped), and the global max logits it used."""

    q: Tensor
    k: Tensor
    max_logits: Tensor


# ----------------------------------------------------------------------------- pure math
def qk_clip_factors(
    max_logits: Tensor, num_kv_heads: int, *, threshold: float = 100.0, alpha: float = 0.5
) -> tuple[Tensor, Tensor]:
    """Float32 (query factors ``[num_heads]``, key factors ``[num_kv_heads]``) from global max logits.

    ``eta_h = threshold / s_h`` where ``s_h > threshold``, else 1 (also for ``-inf``: a head nobody
    computed). Query head ``h`` gets ``eta_h ** alpha``. Under GQA query head ``h`` reads key head
    ``h // (num_heads // num_kv_heads)`` (Hugging Face's ``repeat_kv``), and a key head shared by
    several query heads takes the smallest ``eta ** (1 - alpha)`` among them, so no query head that
    reads it keeps a logit above the threshold. No communication.
    """
    if max_logits.ndim != 1 or num_kv_heads < 1 or max_logits.numel() % num_kv_heads:
        raise ValueError(
            f"qk_clip_factors: max_logits has shape {tuple(max_logits.shape)}, which is not one value per query "
            f"head for {num_kv_heads} key heads; pass [num_heads] with num_heads a multiple of num_kv_heads"
        )
    s = max_logits.detach().float()
    # A tensor numerator: ``float / tensor`` is reciprocal-then-multiply (two roundings) in torch.
    eta = torch.where(s > threshold, torch.full_like(s, threshold) / s, torch.ones_like(s))
    q = eta.pow(alpha)
    k = eta.pow(1.0 - alpha).view(num_kv_heads, -1).amin(dim=1)
    return q, k


@functools.lru_cache(maxsize=512)
def _row_intervals(shape: tuple[int, ...], shards: tuple[AxisShard, ...], flat: int) -> tuple[Interval, ...]:
    """This rank's row intervals (cached: shard_blocks lists every rank's block)."""
    return shard_blocks(shape, shards)[flat][0]


def local_rows(w: Tensor, name: str) -> Tensor:
    """The global row index of each row of ``w``'s local tensor, in local order: every row for a
    plain tensor or a DTensor whose rows are not sharded; this rank's block rows otherwise (any
    supported placement: Shard, uneven and empty shards, _StridedShard)."""
    if not isinstance(w, DTensor):
        return torch.arange(w.shape[0])
    shards = tuple(_shards(w, name))
    coord = w.device_mesh.get_coordinate()
    assert coord is not None, "check_placements refused ranks outside the mesh"
    flat = 0
    for s in shards:  # shard_blocks' order: row-major over the sharded mesh axes
        flat = flat * s.size + coord[s.axis]
    intervals = _row_intervals(tuple(w.shape), shards, flat) if shards else ((0, w.shape[0]),)
    return torch.cat([torch.arange(a, b) for a, b in intervals])


def _scale_rows_(w: Tensor, factors: Tensor, head_dim: int, name: str) -> None:
    """Multiply each local row of ``w`` by its head's factor, in place (one op per element)."""
    local = local_of(w)
    if local.numel() == 0:  # an empty FSDP2 piece may be (0, 0)
        return
    rows = local_rows(w, name)
    assert local.shape[0] == rows.numel(), f"{name}: local rows {local.shape[0]} vs layout {rows.numel()}"
    per_row = factors[rows // head_dim].to(local.device)
    # float32 factor, weight-dtype result: a bf16 weight times an f32 factor is an f32 product, rounded
    # to bf16 on store; the same per element wherever the element sits.
    local.mul_(per_row.unsqueeze(1))


# ----------------------------------------------------------------------------- checks
class _Layer(NamedTuple):
    where: str  # what this layer's errors start with: "" for qk_clip_, "layer 'name': " otherwise
    name: str
    q: Any
    k: Any
    logits: Any
    heads: int  # query and key heads; 0 where a check failed
    kv_heads: int


def _check_args(head_dim: object, threshold: object, alpha: object) -> None:
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ValueError(f"head_dim should be a positive int but is {head_dim!r}; pass the width of one head")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < math.inf:
        raise ValueError(f"threshold should be a finite number > 0 but is {threshold!r}; Kimi K2 uses 100.0")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha should be between 0 and 1 but is {alpha!r}; 0.5 scales q and k alike")


def _check_weight(w: object, name: str, head_dim: int) -> int:
    """The number of heads of weight ``w``; raises naming ``name``."""
    if not isinstance(w, Tensor) or w.ndim != 2 or not w.dtype.is_floating_point:
        what = f"a {w.ndim}-D {w.dtype} tensor" if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(
            f"{name} should be a 2-D floating-point nn.Linear weight [heads * head_dim, in] but is {what}"
        )
    if w.shape[0] % head_dim:
        raise ValueError(
            f"{name} has {w.shape[0]} rows, not a multiple of head_dim={head_dim}; pass the projection's "
            "nn.Linear weight [heads * head_dim, in] (not transposed) and the width of one head"
        )
    check_placements(w, name)
    return w.shape[0] // head_dim


def _check_layer(entry: object, head_dim: int) -> tuple[int, int]:
    """(query heads, key heads) of one layer's ``(q_weight, k_weight, max_logits)``."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 3:
        raise ValueError(f"should be (q_weight, k_weight, max_logits) but is a {type(entry).__name__}")
    q, k, _ = entry
    heads, kv_heads = _check_weight(q, "q_weight", head_dim), _check_weight(k, "k_weight", head_dim)
    if heads % kv_heads:
        raise ValueError(
            f"q_weight has {heads} heads and k_weight {kv_heads} (head_dim={head_dim}): the query heads "
            "should be a multiple of the key heads; check head_dim and the order of q_weight, k_weight"
        )
    if (qm := getattr(q, "device_mesh", None)) != (km := getattr(k, "device_mesh", None)):
        raise ValueError(
            f"q_weight and k_weight should be on the same device mesh (or both plain tensors) but q_weight "
            f"is on {qm} and k_weight on {km}; pass the q and k weights of one attention layer"
        )
    return heads, kv_heads


def _prepare(
    fn: str, items: list[tuple[str, str, Any]], head_dim: Any, threshold: Any, alpha: Any
) -> tuple[list[_Layer], str | None]:
    """Every layer with its head counts, and the first local error: raised only once every rank of
    the layers' meshes knows of it (``_reduce_scope``), so no rank is left waiting."""
    error, layers = None, []
    try:
        _check_args(head_dim, threshold, alpha)
    except ValueError as e:
        error = f"{fn}: {e}"
    for where, name, entry in items:
        counts = (0, 0)
        if error is None:
            try:
                counts = _check_layer(entry, head_dim)
            except ValueError as e:
                error = f"{fn}: {where}{e}"
        q, k, logits = entry if isinstance(entry, (tuple, list)) and len(entry) == 3 else (None, None, None)
        layers.append(_Layer(where, name, q, k, logits, *counts))
    return layers, error


# ----------------------------------------------------------------------------- agreement
def _text(w: object) -> str:
    placed = f" {w.placements}" if isinstance(w, DTensor) else ""
    return f"{w.dtype} of shape {tuple(w.shape)}{placed}" if isinstance(w, Tensor) else type(w).__name__


def _description(
    fn: str, layers: list[_Layer], head_dim: Any, threshold: Any, alpha: Any
) -> list[tuple[str, Any]]:
    """What every rank of a scope must pass alike, as (argument, value) pairs (100 and 100.0 agree)."""
    t, a = (float(x) if type(x) in (int, float) else plain(x) for x in (threshold, alpha))
    out = [
        ("the call", fn), ("head_dim", plain(head_dim)), ("threshold", t), ("alpha", a),
        ("the layers", tuple(layer.name for layer in layers)),
    ]  # fmt: skip
    for layer in layers:
        out += [(f"{layer.where}q_weight", _text(layer.q)), (f"{layer.where}k_weight", _text(layer.k))]
    return out


def _gather_all(value: Any, scope: Scope) -> dict[int, Any]:
    """Every rank's ``value`` in ``scope`` by global rank, on every rank: gathered axis after axis,
    so every rank of a mesh, not only those sharing an axis with this one. Only after a failure."""
    if scope is None:
        return {0: value}
    groups = [scope.get_group(a) for a in range(scope.ndim)] if isinstance(scope, DeviceMesh) else [scope]
    known = {dist.get_rank(): value}
    for group in groups:
        known = {r: v for part in comm.gather_objects(known, group) for r, v in part.items()}
    return known


def _disagreement(fn: str, scope: Scope, desc: list[tuple[str, Any]]) -> str:
    """The digests differ: the first argument in which two ranks differ, with both values."""
    everyone = _gather_all(desc, scope)
    ranks, first = sorted(everyone), everyone[min(everyone)]
    other = next((r for r in ranks if repr(everyone[r]) != repr(first)), ranks[0])
    pairs = itertools.zip_longest(first, everyone[other], fillvalue=("", "nothing"))
    (key, a), (key_b, b) = next((x for x in pairs if repr(x[0]) != repr(x[1])), (("", ""), ("", "")))
    arg, where = key or key_b, f"the mesh {scope}" if isinstance(scope, DeviceMesh) else "the default group"
    return (
        f"{fn}: ranks disagree about {arg}: {a!r} on rank {ranks[0]}, {b!r} on rank {other}; pass the same "
        f"{arg} on every rank of {where}. No weight changed"
    )


def _shared_error(scope: Scope, error: str | None) -> str:
    """Some rank of ``scope`` failed a check: every rank raises the lowest such rank's error."""
    everyone = _gather_all(error, scope)
    rank, text = min((r, e) for r, e in everyone.items() if e is not None)  # the flag says one exists
    same = all(e == text for e in everyone.values())
    return text if same else f"{text} (on rank {rank}; every rank raises this)"


# ----------------------------------------------------------------------------- collective
# The first all-reduce of a scope holds 4,096 floats whatever the arguments: ranks that disagree
# still meet in collectives of one size. Its head: the digest's pieces, their negatives (MAX gives
# both max and min), a failure flag.
_FIRST, _HEAD = 4096, 7


def _scope_of(q: object) -> Scope:
    if isinstance(q, DTensor):  # a rank outside the mesh does not reduce over it: check_placements raises
        return q.device_mesh if q.device_mesh.get_coordinate() is not None else None
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _max(values: Tensor, scope: Scope, device_type: str) -> Tensor:
    if isinstance(scope, DeviceMesh):
        return comm.max_over_mesh(values, scope)
    return values.clone() if scope is None else comm.max_over_group(values, scope, device_type)


def _local_values(x: object, heads: int, device: torch.device) -> tuple[Tensor, bool]:
    """This rank's values (float32 on ``device``), and whether it passed something unusable."""
    if (
        isinstance(x, Tensor)
        and not isinstance(x, DTensor)
        and x.dtype.is_floating_point
        and x.shape == (heads,)
    ):
        return x.detach().float().to(device), False
    return torch.full((heads,), -math.inf, device=device), True


def _body(layers: list[_Layer], rank: int) -> tuple[Tensor, Tensor]:
    """``[wrong per layer, broken per layer, values]`` as float32 on the host (a flag: rank + 1 where
    max_logits has the wrong type or shape, or NaN or +inf), and this rank's flags as 0 or 1."""
    device = next((x.device for x in (layer.logits for layer in layers) if isinstance(x, Tensor)), None)
    got = [_local_values(layer.logits, layer.heads, device or torch.device("cpu")) for layer in layers]
    broken = torch.stack([(v.isnan() | (v == math.inf)).any() for v, _ in got]).float()
    host, n = torch.cat([broken, *(v for v, _ in got)]).cpu(), len(layers)  # the one copy from the device
    mine = torch.cat([torch.tensor([float(wrong) for _, wrong in got]), host[:n]])
    return torch.cat([mine * (rank + 1), host[n:]]), mine


def _reduce_scope(
    fn: str, scope: Scope, layers: list[_Layer], desc: list[tuple[str, Any]], error: str | None
) -> tuple[list[Tensor], str | None]:
    """The MAX over ``scope`` of its layers' max logits (one all-reduce per mesh axis while they fit
    in ``_FIRST`` floats) with the arguments' digest and every rank's failures; or the error."""
    rank = dist.get_rank() if scope is not None else 0
    pieces = digest_pieces(repr(desc))
    head = torch.tensor([*pieces, *(-p for p in pieces), float(error is not None)])
    body, mine = _body(layers, rank) if error is None else (torch.empty(0), torch.empty(0))
    sent = torch.cat([head, body, torch.full((max(0, _FIRST - _HEAD - body.numel()),), -math.inf)])
    device_type = next((local_of(x.q).device.type for x in layers if isinstance(x.q, Tensor)), "cpu")
    first = _max(sent[:_FIRST], scope, device_type)
    if any(first[i] != -first[i + 3] for i in range(3)):
        return [], _disagreement(fn, scope, desc)
    if first[_HEAD - 1] > 0:
        return [], _shared_error(scope, error)
    rest = _max(sent[_FIRST:], scope, device_type) if sent.numel() > _FIRST else sent[:0]
    return _unpack(fn, torch.cat([first, rest])[_HEAD:], layers, mine)


def _unpack(fn: str, reduced: Tensor, layers: list[_Layer], mine: Tensor) -> tuple[list[Tensor], str | None]:
    n = len(layers)
    maxima = list(reduced[2 * n : 2 * n + sum(x.heads for x in layers)].split([x.heads for x in layers]))
    for kind, flags in enumerate((reduced[:n], reduced[n : 2 * n])):
        bad = flags.nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            here = f" (this rank passed {_text(layers[i].logits)})" if mine[kind * n + i] else ""
            text = _FLAGS[kind].format(heads=layers[i].heads, rank=int(flags[i]) - 1, here=here)
            return maxima, f"{fn}: {layers[i].where}{text}"
    return maxima, None


_FLAGS = (  # max_logits is the one argument that differs per rank: its problems travel as flags
    "max_logits should be a plain float tensor of shape ({heads},), one value per query head (-inf for "
    "heads a rank did not compute), but rank {rank} passed another{here}; no weight changed",
    "max_logits holds NaN or +inf on rank {rank}{here}; every rank raises this and no weight changed. "
    "The forward pass overflowed: find the NaN, or skip QK-Clip for this step",
)


# ----------------------------------------------------------------------------- the calls
def _clip(
    fn: str, items: list[tuple[str, str, Any]], head_dim: Any, threshold: Any, alpha: Any
) -> list[QKClipFactors]:
    """Check, reduce every scope (in order of first appearance), raise together, then scale."""
    layers, error = _prepare(fn, items, head_dim, threshold, alpha)
    scopes: dict[Scope, list[int]] = {}
    for i, layer in enumerate(layers):
        scopes.setdefault(_scope_of(layer.q), []).append(i)
    maxima: dict[int, Tensor] = {}
    for scope, members in scopes.items():
        mine = [layers[i] for i in members]
        desc = _description(fn, mine, head_dim, threshold, alpha)
        found, error = _reduce_scope(fn, scope, mine, desc, error)
        maxima.update(zip(members, found))
    if error is not None:
        raise ValueError(error)
    return [_apply(x, maxima[i], head_dim, float(threshold), float(alpha)) for i, x in enumerate(layers)]


def _apply(layer: _Layer, s: Tensor, head_dim: int, threshold: float, alpha: float) -> QKClipFactors:
    q_factors, k_factors = qk_clip_factors(s, layer.kv_heads, threshold=threshold, alpha=alpha)
    if bool((s > threshold).any()):  # else every factor is 1: nothing to write
        _scale_rows_(layer.q, q_factors, head_dim, "q_weight")
        _scale_rows_(layer.k, k_factors, head_dim, "k_weight")
    device = local_of(layer.q).device
    return QKClipFactors(q_factors.to(device), k_factors.to(device), s.to(device))


@torch.no_grad()
def qk_clip_(
    q_weight: Tensor, k_weight: Tensor, max_logits: Tensor, *, head_dim: int, threshold: float = 100.0,
    alpha: float = 0.5,
) -> QKClipFactors:  # fmt: skip
    """QK-Clip one attention layer in place; returns the factors (``QKClipFactors``) for logging.

    ``q_weight`` ``[num_heads * head_dim, hidden]`` and ``k_weight`` ``[num_kv_heads * head_dim,
    hidden]`` are ``nn.Linear`` weights, plain tensors or DTensors in any layout the optimizer
    supports, both on one mesh. ``max_logits`` (float ``[num_heads]``) is this rank's largest
    ``q.k / sqrt(head_dim)`` per query head since the last clip, ``-inf`` for heads it did not
    compute. Heads whose global max exceeds ``threshold`` get q rows scaled by ``eta ** alpha`` and
    k rows by ``eta ** (1 - alpha)``, ``eta = threshold / max``; a GQA key head takes the smallest
    factor of its query heads. Factors are float32; each element is multiplied once.

    Collective over the weights' mesh (the default group for plain tensors): one MAX all-reduce
    per mesh axis, which also carries a digest of the other arguments and every rank's failures, so
    a bad argument or ranks that disagree (``head_dim``, ``threshold``, ``alpha``, the weights'
    shapes) raise the same ``ValueError`` on every rank, no weight changed. Optimizer state is left
    as it is. ``qk_clip_all_`` clips every layer in one all-reduce.
    """
    return _clip("qk_clip_", [("", "", (q_weight, k_weight, max_logits))], head_dim, threshold, alpha)[0]


@torch.no_grad()
def qk_clip_all_(
    layers: Mapping[str, tuple[Tensor, Tensor, Tensor]] | Sequence[tuple[Tensor, Tensor, Tensor]],
    *, head_dim: int, threshold: float = 100.0, alpha: float = 0.5,
) -> list[QKClipFactors]:  # fmt: skip
    """``qk_clip_`` for every layer: one MAX all-reduce per axis of each distinct mesh (the default
    group for plain tensors) whatever the number of layers, while a mesh's layers hold fewer than
    about 4,000 query heads (two beyond). Bit for bit ``qk_clip_`` layer by layer.

    ``layers``: ``(q_weight, k_weight, max_logits)`` per layer, keyed by name (errors name it) or in
    a sequence; the same layers in the same order on every rank of their mesh. ``head_dim``,
    ``threshold`` and ``alpha`` as for ``qk_clip_``, one for all layers. Returns each layer's
    ``QKClipFactors`` in order. Any error on any rank raises on every rank before a weight changes.
    """
    if not isinstance(layers, (Mapping, list, tuple)):
        raise ValueError(
            f"qk_clip_all_: layers should be a dict of name: (q_weight, k_weight, max_logits) or a list of "
            f"such tuples but is a {type(layers).__name__}"
        )
    named = layers.items() if isinstance(layers, Mapping) else enumerate(layers)
    items = [(f"layer {name!r}: ", str(name), entry) for name, entry in named]
    return _clip("qk_clip_all_", items, head_dim, threshold, alpha)
