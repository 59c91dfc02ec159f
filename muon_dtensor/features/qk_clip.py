"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534, section 2.1) on plain or sharded q/k weights.

After an optimizer step, a head ``h`` whose largest pre-softmax logit ``s_h`` (``q.k / sqrt(head_dim)``
over the step's batch) exceeds ``threshold`` gets its query rows scaled by ``(threshold / s_h) ** alpha``
and its key rows by ``(threshold / s_h) ** (1 - alpha)``, so its largest logit on that batch becomes
``threshold``. Only the weights change; optimizer state (momentum) does not.

Every rank must scale by the same factors, so ``s_h`` is the MAX over every rank of the weights'
mesh before anything is computed from it (ms-swift's MuonClip applied process-local maxima and its
data-parallel replicas drifted apart until it all-reduced them, modelscope/ms-swift#9901): one MAX
all-reduce per mesh axis for every layer of the mesh at once. Before it, the ranks agree over a group
every rank can name (the default group, or ``process_group``) on the arguments, the layers and their
meshes in order, and on every rank's failures (``checks/together.py``): a rank that passed no layer,
other layers, another order or a bad value raises the same error as every other rank, never a hang.

Exactness: the factors are computed in float32 on the host from the reduced maxima, identical bits
on every rank; each weight element is then multiplied once by its head's float32 factor (the result
rounded to the weight's dtype), so a shard's rows are the same rows of the one-process result.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..checks import together
from ..checks.agreement import plain
from ..checks.group_identity import agree_group, group_key
from ..sharding.plan.blocks import AxisShard, Interval, shard_blocks
from ..sharding.plan.param_layout import check_placements, local_of, shards_of
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
    shards = tuple(shards_of(w, name))
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
) -> tuple[list[_Layer], ValueError | None]:
    """Every layer with its head counts, and this rank's first error (arguments, weights, and its
    own max_logits): raised only once every rank knows of it (``together.raise_together``)."""
    error, layers = None, []
    try:
        _check_args(head_dim, threshold, alpha)
    except ValueError as e:
        error = ValueError(f"{fn}: {e}")
    for where, name, entry in items:
        counts = (0, 0)
        if error is None:
            try:
                counts = _check_layer(entry, head_dim)
                _check_logits(entry[2], counts[0])
            except ValueError as e:
                error = ValueError(f"{fn}: {where}{e}")
        q, k, logits = entry if isinstance(entry, (tuple, list)) and len(entry) == 3 else (None, None, None)
        layers.append(_Layer(where, name, q, k, logits, *counts))
    return layers, error


def _check_logits(x: object, heads: int) -> None:
    """This rank's max_logits: a plain float tensor ``[heads]`` with no NaN or +inf (reads it: a sync)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not (
        isinstance(x, Tensor)
        and not isinstance(x, DTensor)
        and x.dtype.is_floating_point
        and x.shape == (heads,)
    ):
        raise ValueError(
            f"max_logits should be a plain float tensor of shape ({heads},), one value per query head (-inf "
            f"for heads a rank did not compute), but rank {rank} passed {_text(x)}; no weight changed"
        )
    if bool((x.isnan() | (x == math.inf)).any()):
        raise ValueError(
            f"max_logits holds NaN or +inf on rank {rank}; every rank raises this and no weight changed. The "
            "forward pass overflowed: find the NaN, or skip QK-Clip for this step"
        )


# ----------------------------------------------------------------------------- agreement
def _text(w: object) -> str:
    if isinstance(w, DTensor):
        mesh = w.device_mesh
        # the mesh's shape and names, not its ranks: stages or sub-meshes legitimately hold other ranks
        return f"{w.dtype} of shape {tuple(w.shape)} {w.placements} on a mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}"
    return f"{w.dtype} of shape {tuple(w.shape)}" if isinstance(w, Tensor) else type(w).__name__


def _arguments(
    layers: list[_Layer], head_dim: Any, threshold: Any, alpha: Any, given_group: bool
) -> dict[str, Any]:
    """What every rank must pass alike (100 and 100.0 agree): each layer's name, weights and mesh,
    in order, so the meshes are reduced in one order everywhere."""
    t, a = (float(x) if type(x) in (int, float) else plain(x) for x in (threshold, alpha))
    out: dict[str, Any] = {"head_dim": plain(head_dim), "threshold": t, "alpha": a}
    out["process_group"] = "given" if given_group else "none (the default group)"
    out["the layers"] = tuple(layer.name for layer in layers)
    for layer in layers:
        out[f"{layer.where}q_weight"], out[f"{layer.where}k_weight"] = _text(layer.q), _text(layer.k)
    return out


# ----------------------------------------------------------------------------- collective
def _scope_of(q: object, group: dist.ProcessGroup | None) -> Scope:
    if isinstance(q, DTensor):  # a rank outside the mesh does not reduce over it: check_placements raises
        return q.device_mesh if q.device_mesh.get_coordinate() is not None else None
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _fake_mesh(layers: list[_Layer]) -> ValueError | None:
    """A weight on a mesh with a fake axis of several ranks in a real job: its max would be this
    rank's alone (``comm.fake_refusal``)."""
    meshes = [(layer.q.device_mesh, layer.where) for layer in layers if isinstance(layer.q, DTensor)]
    why = next((r for m, w in meshes if (r := comm.fake_refusal(m, f"{w}q_weight's mesh")) is not None), None)
    return None if why is None else ValueError(why)


def _max(values: Tensor, scope: Scope, device_type: str) -> Tensor:
    if isinstance(scope, DeviceMesh):
        return comm.max_over_mesh(values, scope)
    return values.detach().cpu().clone() if scope is None else comm.max_over_group(values, scope, device_type)


# ----------------------------------------------------------------------------- the calls
def _clip(
    fn: str, items: list[tuple[str, str, Any]], head_dim: Any, threshold: Any, alpha: Any,
    group: dist.ProcessGroup | None, unnamed: ValueError | None = None,
) -> list[QKClipFactors]:  # fmt: skip
    """Check locally, agree over ``group`` (the default group where None: every rank can name it),
    then one MAX all-reduce per axis of each mesh, in the agreed order, then scale."""
    if group is not None:  # every rank passed this very group, or the ranks would wait in different ones
        key, failed = together.attempt(lambda: group_key(group, "process_group"))
        agree_group(fn, "process_group", failed, key, "No weight changed")
    layers, error = _prepare(fn, items, head_dim, threshold, alpha)
    together.raise_together(
        error or unnamed or _fake_mesh(layers),
        group,
        fn,
        _arguments(layers, head_dim, threshold, alpha, group is not None),
        "No weight changed",
    )
    scopes: dict[Scope, list[int]] = {}
    for i, layer in enumerate(layers):
        scopes.setdefault(_scope_of(layer.q, group), []).append(i)
    maxima: dict[int, Tensor] = {}
    for scope, members in scopes.items():
        values = torch.cat([layers[i].logits.detach().float() for i in members])
        device_type = local_of(layers[members[0]].q).device.type
        reduced = _max(values, scope, device_type)
        maxima.update(zip(members, reduced.split([layers[i].heads for i in members])))
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
    alpha: float = 0.5, process_group: dist.ProcessGroup | None = None,
) -> QKClipFactors:  # fmt: skip
    """QK-Clip one attention layer in place; returns the factors (``QKClipFactors``) for logging.

    ``q_weight`` ``[num_heads * head_dim, hidden]`` and ``k_weight`` ``[num_kv_heads * head_dim,
    hidden]`` are ``nn.Linear`` weights, plain tensors or DTensors in any layout the optimizer
    supports, both on one mesh. ``max_logits`` (float ``[num_heads]``) is this rank's largest
    ``q.k / sqrt(head_dim)`` per query head since the last clip, ``-inf`` for heads it did not
    compute. Heads whose global max exceeds ``threshold`` get q rows scaled by ``eta ** alpha`` and
    k rows by ``eta ** (1 - alpha)``, ``eta = threshold / max``; a GQA key head takes the smallest
    factor of its query heads. Factors are float32; each element is multiplied once.

    Collective: first one integer sum over ``process_group`` (default: the default group, which
    every rank can name; a pipeline stage passes its own group, which is first checked over the
    default group to be the group each of its ranks passed), so a bad argument or ranks that
    disagree (``head_dim``, ``threshold``, ``alpha``, the weights' shapes, placements and mesh)
    raise the same ``ValueError`` on every rank, no weight changed; then one MAX all-reduce per axis
    of the weights' mesh (``process_group`` for plain tensors). Optimizer state is left as it is.
    ``qk_clip_all_`` clips every layer with one all-reduce per mesh.
    """
    items = [("", "", (q_weight, k_weight, max_logits))]
    return _clip("qk_clip_", items, head_dim, threshold, alpha, process_group)[0]


@torch.no_grad()
def qk_clip_all_(
    layers: Mapping[str, tuple[Tensor, Tensor, Tensor]] | Sequence[tuple[Tensor, Tensor, Tensor]],
    *, head_dim: int, threshold: float = 100.0, alpha: float = 0.5,
    process_group: dist.ProcessGroup | None = None,
) -> list[QKClipFactors]:  # fmt: skip
    """``qk_clip_`` for every layer: one agreement sum over ``process_group``, then one MAX
    all-reduce per axis of each distinct mesh (``process_group`` for plain tensors) whatever the
    number of layers. Bit for bit ``qk_clip_`` layer by layer.

    ``layers``: ``(q_weight, k_weight, max_logits)`` per layer, keyed by name (errors name it) or in
    a sequence; the same layers in the same order on every rank. With several ranks a sequence
    holding two layers of the same shapes and layout is refused: name them (a dict), since ranks
    compare names but cannot compare an order. ``head_dim``,
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
    unnamed = None if isinstance(layers, Mapping) else _same_in_a_list(items)
    return _clip("qk_clip_all_", items, head_dim, threshold, alpha, process_group, unnamed)


def _same_in_a_list(items: list[tuple[str, str, Any]]) -> ValueError | None:
    """Across ranks a list's layers are told apart by their order alone: two of the same shapes and
    layout, swapped on one rank, would be clipped with each other's logits and no rank could tell.
    With several ranks such a list is refused (its names, in a dict, are compared)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    seen: dict[str, str] = {}
    for _, name, entry in items:
        if isinstance(entry, (tuple, list)) and len(entry) == 3:
            key = _text(entry[0]) + _text(entry[1])
            if key in seen:
                return ValueError(
                    f"qk_clip_all_: layers {seen[key]} and {name} of the list have the same shapes and layout, "
                    "so their order is all that tells them apart, which ranks cannot check against each "
                    "other; pass a dict {name: (q_weight, k_weight, max_logits)}, whose names every rank "
                    "compares (no weight changed)"
                )
            seen[key] = name
    return None
