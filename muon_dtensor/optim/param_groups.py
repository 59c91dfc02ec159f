"""Split a model's parameters the usual way: hidden 2-D matrices to Muon, the rest to AdamW.

Muon is meant for hidden-layer matrices (Keller Jordan, "Muon: An optimizer for hidden layers in
neural networks"); embeddings, the output head, norms and biases stay with AdamW. With ``head_dim``,
the q, k, v projections get a Muon group of their own that orthogonalizes each head separately.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..base.names import (
    DEFAULT_HEAD_NAMES,
    DEFAULT_QKV_NAMES,
    NOT_HEAD_NAMES,
    matches,
    module_of,
    strip_wrappers,
)
from ..base.torch_dist import is_fsdp1_flat_param

__all__ = ["DEFAULT_HEAD_NAMES", "DEFAULT_QKV_NAMES", "split_params"]


def _embedding_params(model: nn.Module) -> set[int]:
    return {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag)
        for p in module.parameters(recurse=False)
    }


def _owners(model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> class name of the module that holds it."""
    return {
        f"{prefix}.{name}" if prefix else name: type(module).__name__
        for prefix, module in model.named_modules()
        for name, _ in module.named_parameters(recurse=False)
    }


def split_params(
    model: nn.Module,
    *,
    muon: Sequence[str] = (),
    adamw: Sequence[str] = (),
    head_names: Sequence[str] = DEFAULT_HEAD_NAMES,
    adamw_options: dict[str, Any] | None = None,
    head_dim: int | None = None,
    qkv: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for ``muon_dtensor.Muon``: ``[{muon group}, {"algorithm": "adamw", ...}]``.

    Args:
        model: the model (before or after ``fully_shard``; names are the same).
        muon: glob patterns of parameter names forced into the Muon group.
        adamw: glob patterns of parameter names forced into the AdamW group (wins over ``muon``).
        head_names: module names treated as output heads.
        adamw_options: extra keys for the AdamW group (``lr``, ``betas``, ``eps``, ``weight_decay``).
        head_dim: rows per attention head: the Muon matrices of modules named by ``qkv`` get a
            second Muon group, ``{"head_dim": head_dim}``, placed after the first.
        qkv: names (globs) of the q, k, v projection modules, the last component of the module path;
            only with ``head_dim``; default ``DEFAULT_QKV_NAMES``.
    Parameters keep their names, so errors and checkpoints use FQNs. Frozen parameters are left out.
    Raises ValueError where ``head_dim`` would reach no matrix, or a matrix whose rows are not heads
    (an output projection, an MLP, a transposed ``Conv1D``); where the model yields no Muon matrix;
    and where 2-D weights arrive as flat 1-D shards (FSDP1's ``FlatParameter``, ZeRO-style
    flattening), since Muon needs each weight's matrix shape.
    """
    if qkv is not None and head_dim is None:
        raise ValueError(f"split_params: qkv={tuple(qkv)!r} needs head_dim (rows per attention head)")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(f"split_params: head_dim must be a positive int (rows per head) but is {head_dim!r}")
    _refuse_flattened(model)
    groups = _sort(model, muon, adamw, head_names)
    if not groups["muon"]:
        _refuse_no_matrices(groups["adamw"])
    if head_dim is not None:
        names = DEFAULT_QKV_NAMES if qkv is None else tuple(qkv)
        groups["heads"] = _take_heads(model, groups["muon"], names, head_dim)
    out: list[dict[str, Any]] = []
    if groups["muon"]:
        out.append({"params": groups["muon"], "algorithm": "muon"})
    if groups.get("heads"):
        out.append({"params": groups["heads"], "algorithm": "muon", "head_dim": head_dim})
    if groups["adamw"]:
        out.append({"params": groups["adamw"], "algorithm": "adamw", **(adamw_options or {})})
    return out


def _sort(
    model: nn.Module, muon: Sequence[str], adamw: Sequence[str], head_names: Sequence[str]
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """``{"muon": [...], "adamw": [...]}``: each trainable (name, parameter) in its group."""
    embeddings = _embedding_params(model)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"muon": [], "adamw": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = strip_wrappers(name)
        module_name = plain.rsplit(".", 1)[0] if "." in plain else ""
        is_head = module_name.rsplit(".", 1)[-1] in head_names
        hidden = p.ndim == 2 and id(p) not in embeddings and not is_head
        if matches(plain, adamw):
            hidden = False
        elif matches(plain, muon):
            hidden = True
        groups["muon" if hidden else "adamw"].append((name, p))
    return groups


def _take_heads(
    model: nn.Module, muon: list[tuple[str, nn.Parameter]], qkv: tuple[str, ...], head_dim: int
) -> list[tuple[str, nn.Parameter]]:
    """Move the Muon matrices of ``qkv`` modules out of ``muon`` (in place) and return them, after
    refusing names whose rows are not heads."""
    heads = [(n, p) for n, p in muon if matches(module_of(n), qkv)]
    if not heads:
        some = ", ".join(n for n, _ in muon[:6]) or "none"
        raise ValueError(
            f"split_params: head_dim={head_dim} reaches no matrix: no Muon parameter's module is named "
            f"like qkv={qkv!r} (Muon parameters: {some}). Pass qkv= the module names of your q, k, v "
            "projections, e.g. qkv=('q', 'k', 'v')"
        )
    owners = _owners(model)
    wrong = [n for n, _ in heads if module_of(n) in NOT_HEAD_NAMES or owners.get(n) == "Conv1D"]
    if wrong:
        raise ValueError(
            f"split_params: head_dim={head_dim} would cut matrices whose rows are not attention heads "
            f"(output projections, MLPs, or a transposed Conv1D whose heads are columns): {wrong}. "
            f"Narrow qkv={qkv!r} to the q, k, v projections (a group built by hand can still set "
            "head_dim on anything: docs/api.md)"
        )
    uneven = [f"{n} {tuple(p.shape)}" for n, p in heads if p.shape[0] % head_dim]
    if uneven:
        raise ValueError(
            f"split_params: head_dim={head_dim} does not divide the rows of {uneven}; give the rows per "
            "head (the projection's out_features / heads), or narrow qkv"
        )
    taken = {id(p) for _, p in heads}
    muon[:] = [(n, p) for n, p in muon if id(p) not in taken]
    return heads


def _refuse_flattened(model: nn.Module) -> None:
    """2-D weights that arrive as flat 1-D shards have lost the shape Muon orthogonalizes."""
    flat = []
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            fqn = f"{prefix}.{name}" if prefix else name
            if is_fsdp1_flat_param(p):
                flat.append(f"{fqn} (an FSDP1 FlatParameter of {p.numel():,} elements)")
            elif len(getattr(p, "ds_shape", ())) == 2 and p.ndim != 2:
                flat.append(f"{fqn} (a ZeRO-3 partition of a {tuple(p.ds_shape)} weight)")
            elif name == "weight" and isinstance(module, nn.Linear) and p.ndim != 2:
                flat.append(f"{fqn} (an nn.Linear weight held as shape {tuple(p.shape)})")
    if flat:
        raise ValueError(
            f"split_params: 2-D weights arrive as flat 1-D shards: {', '.join(flat[:6])}"
            f"{f' and {len(flat) - 6} more' if len(flat) > 6 else ''}. Muon orthogonalizes each "
            "weight's matrix, which a flattened shard no longer has. Shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), whose parameters are DTensors of their global "
            "shapes, instead of FSDP1 or ZeRO flattening; or call split_params and build Muon before "
            "the model is flattened and step the optimizer on the original parameters"
        )


def _refuse_no_matrices(others: list[tuple[str, nn.Parameter]]) -> None:
    shown = ", ".join(f"{n} {tuple(p.shape)}" for n, p in others[:6]) or "no trainable parameter"
    more = f" and {len(others) - 6} more" if len(others) > 6 else ""
    raise ValueError(
        f"split_params: the model yields no Muon matrix: no trainable 2-D weight outside embeddings "
        f"and output heads (its parameters: {shown}{more}). Muon orthogonalizes hidden matrices; "
        "train this model with AdamW alone (torch.optim.AdamW), name its matrices with muon=[...] "
        "patterns, or for conv or expert weights build a Muon group with 'flatten' or 'experts'"
    )
