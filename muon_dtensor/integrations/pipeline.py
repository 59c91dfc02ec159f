"""Pipeline stages without the glue: a model cut into stages by FQN prefixes (names stay the whole
model's, so a stage's checkpoint keys are the merged model's), run with torch's ``PipelineStage`` and
schedules, and the merged resume's step, the schedule's arithmetic as one call (docs/torchtitan.md).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

__all__ = ["even_prefixes", "hf_decoder", "keep_prefixes", "merged_step", "pipeline_step", "stage_schedule"]


def _kept(fqn: str, prefixes: Sequence[str]) -> bool:
    return any(fqn == p or fqn.startswith(p + ".") for p in prefixes)


def _above(fqn: str, prefixes: Sequence[str]) -> bool:
    return any(p.startswith(fqn + ".") for p in prefixes)


def keep_prefixes(model: nn.Module, prefixes: Sequence[str]) -> nn.Module:
    """``model`` with every submodule outside ``prefixes`` (FQN prefixes: ``"layers.0"``,
    ``"tok_embeddings"``) removed in place, as torchtitan cuts stages: an entry of a ``ModuleDict``
    deleted, any other child set to None (the model's forward skips None). Names stay the whole
    model's (``layers.2.*`` stays ``layers.2.*``). A ``ModuleList`` cannot lose an entry without
    renumbering the rest: ValueError naming it (hold the blocks in a ``ModuleDict``, as torchtitan
    does). ValueError too for a prefix that names no submodule, and for ``""`` (the whole model:
    nothing to cut)."""
    if "" in prefixes:
        raise ValueError(
            'prefixes holds "", which names the whole model, not a submodule to keep; pass the '
            "submodules this stage keeps (even_prefixes), or do not call keep_prefixes to keep all"
        )
    names = {name for name, _ in model.named_modules()}
    missing = [p for p in prefixes if p not in names]
    if missing:
        raise ValueError(f"prefixes {missing} name no submodule of {type(model).__name__}")
    _cut(model, "", prefixes)
    return model


def _cut(module: nn.Module, path: str, prefixes: Sequence[str]) -> None:
    for name, child in list(module.named_children()):
        fqn = f"{path}{name}"
        if _kept(fqn, prefixes):
            continue
        if _above(fqn, prefixes):
            _cut(child, fqn + ".", prefixes)
        elif isinstance(module, nn.ModuleDict):
            del module[name]
        elif isinstance(module, nn.ModuleList):
            raise ValueError(
                f"{fqn} is an entry of the ModuleList {path.rstrip('.') or 'model'}: removing it would renumber "
                "the entries after it; hold them in an nn.ModuleDict keyed by index, as torchtitan does"
            )
        else:
            setattr(module, name, None)


def even_prefixes(
    layers: int,
    stages: int,
    *,
    first: Sequence[str],
    last: Sequence[str],
    blocks: str = "layers",
    every: Sequence[str] = (),
) -> list[list[str]]:
    """Each stage's prefixes for ``layers`` blocks named ``<blocks>.<i>`` split evenly into ``stages``:
    ``first`` (the embedding) joins stage 0, ``last`` (the norm, the head) the last stage, ``every``
    (modules without parameters each stage needs: a rotary embedding) each stage."""
    if type(stages) is not int or stages < 1:
        raise ValueError(f"stages should be an int of at least 1 but is {stages!r}")
    if type(layers) is not int or layers < 1 or layers % stages:
        raise ValueError(f"layers should be a positive multiple of stages {stages} but is {layers!r}")
    per = layers // stages
    out = [[f"{blocks}.{i}" for i in range(s * per, (s + 1) * per)] for s in range(stages)]
    out[0] = [*first, *out[0]]
    out[-1] = [*out[-1], *last]
    return [[*every, *stage] for stage in out]


def stage_schedule(
    part: nn.Module,
    stage: int,
    stages: int,
    *,
    device: torch.device,
    group: Any,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor],
    schedule: type = ScheduleGPipe,
) -> Any:
    """torch's ``PipelineStage`` over ``part`` (stage ``stage`` of ``stages``, on ``group``: the "pp"
    process group) and a single-stage schedule of ``schedule``'s class (default ``ScheduleGPipe``)."""
    pipe = PipelineStage(part, stage, stages, device, group=group)
    return schedule(pipe, n_microbatches=n_microbatches, loss_fn=loss_fn)


def pipeline_step(
    schedule: Any,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One optimizer step of a stage: gradients zeroed, the schedule run (``inputs`` on the first
    stage, ``target`` on the last; made contiguous, since the schedule checks each micro-batch's
    strides against the stage's), then ``optimizer.step()``. The mean of the micro-batches' losses on
    the last stage, None elsewhere."""
    optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    args = () if inputs is None else (inputs.contiguous(),)
    schedule.step(*args, target=None if target is None else target.contiguous(), losses=losses)
    optimizer.step()
    return torch.stack(losses).sum() / len(losses) if losses else None


def merged_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """One step of the whole model with a pipeline schedule's arithmetic, so a run resumed with the
    stages merged (FSDP2 over as many ranks as the stages had dp ranks) steps bitwise as the stages:
    the micro-batches' gradients accumulate unsharded and are reduced once, after the last one (as
    ``PipelineStage`` runs FSDP2), then divided by their count. Reducing after every micro-batch
    (FSDP2's default) sums the dp means, not the sums' mean: other bits. ``micro_batches``: this
    rank's (inputs, targets) pairs in the schedule's order. Returns the mean of their losses."""
    optimizer.zero_grad(set_to_none=True)
    n, losses = len(micro_batches), []
    for i, (inputs, targets) in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == n - 1)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.detach())
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(n)
    optimizer.step()
    return torch.stack(losses).sum() / n


def hf_decoder(model: nn.Module) -> nn.Module:
    """A Hugging Face decoder (``LlamaForCausalLM`` and its kind: ``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) made ready to cut, in place:
    its ``ModuleList`` of layers becomes a ``ModuleDict`` keyed by index (the state dict's keys are
    unchanged), and its forward becomes a stage's: token ids (or, on a later stage, hidden states) in,
    logits (or hidden states) out. Each stage recomputes what the layers need beside the hidden
    states, from their shape: the positions, the rotary embeddings (``model.rotary_emb``, without
    parameters: keep it on every stage) and the causal attention mask, passed to each layer as keywords. Use
    the same forward for the merged model (cut nothing), so both run the same arithmetic."""
    inner: Any = model.model
    if isinstance(inner.layers, nn.ModuleList):
        inner.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
    model.forward = types.MethodType(_hf_stage_forward, model)
    return model


def _hf_stage_forward(self: Any, h: torch.Tensor) -> torch.Tensor:
    inner = self.model
    if inner.embed_tokens is not None:
        h = inner.embed_tokens(h)
    seq = h.shape[1]
    positions = torch.arange(seq, device=h.device).unsqueeze(0)
    rotary = inner.rotary_emb(h, positions)
    causal = torch.full((seq, seq), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device).triu(1)
    mask = causal[None, None]  # [batch 1, heads 1, query, key]: 0 where a query may attend, min elsewhere
    for layer in inner.layers.values():
        out = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        h = out[0] if isinstance(out, tuple) else out
    if inner.norm is not None:
        h = inner.norm(h)
    return h if self.lm_head is None else self.lm_head(h)
