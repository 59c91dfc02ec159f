"""Mixture-of-experts laid out by torchtitan 0.3.0 itself, stepped by one ``muon_dtensor.Muon``.

A tiny DeepSeek-V3 (torchtitan's own layer builder: a dense layer, then an MoE layer with a router, a
shared expert and routed ``GroupedExperts`` stacks ``w1_EFD``/``w3_EFD`` ``[E, F, D]``, ``w2_EDF``
``[E, D, F]``) is parallelized on 4 gloo ranks by torchtitan's ``parallelize_deepseekv3``: its
``Module.parallelize`` (the sharding configs of ``set_deepseek_v3_sharding_config``: EP, TP) and its
``apply_fsdp_to_decoder`` (``shard_placement_fn``: experts on the ``efsdp`` mesh, Shard(1) when
efsdp x ep > num_experts). The test asserts the placements torchtitan gave (below), then steps each
layout 3 times on the same full gradients as one process (Muon for the matrices, one
``"experts": True`` group for the stacks, AdamW for embeddings, head and norms): every parameter and
state entry equals one process bit for bit, and each expert matrix is orthogonalized once in the world
(once per replica under HSDP with ``owners="auto"``). torchtitan 0.3.0 never shards experts over EP
and TP together (no expert TP with EP on, moe_sharding.py), so "ep x fsdp x tp" is ``ep2_tp2`` and
``hsdp2_ep2_tp2``; experts tensor-parallel is ``tp2``.

Placements (mesh axes: placements), as torchtitan 0.3.0 lays them out on 4 ranks:

- ``ep2``: dp_shard 4, ep 2 (``partial_dtensor``): experts ``(efsdp 2, ep 2)``:
  ``(_StridedShard(0, sf=2), Shard(0))``; everything else ``(fsdp 4)``: ``Shard(0)``.
- ``ep2_shard1``: the same with 2 experts: efsdp x ep = 4 > 2, so experts ``(Shard(1), Shard(0))``.
- ``ep2_full_dtensor``: ``ep2`` under ``full_dtensor``: the same experts; the rest on ``(dp_shard 4)``.
- ``ep2_tp2``: dp_shard 2, tp 2, ep 2: experts ``(efsdp 2, ep 2)`` as in ``ep2`` (EP borrows the TP
  ranks, efsdp = fsdp x tp / ep: parallel_dims.py ``build_mesh``; with EP on, routed experts take
  ``expert_param_placement_sparse``, EP only: moe_sharding.py); dense ``(fsdp 2, tp 2)``: colwise
  ``(_StridedShard(0, sf=2), Shard(0))``, rowwise ``(Shard(0), Shard(1))``, router
  ``(Shard(0), Replicate())``.
- ``hsdp2_ep2_tp2``: dp_replicate 2, dp_shard 1, tp 2, ep 2: 3-D meshes. Experts
  ``(dp_replicate 2, efsdp 1, ep 2)``: ``(Replicate(), _StridedShard(0, sf=2), Shard(0))``; dense
  ``(dp_replicate 2, fsdp 1, tp 2)``: colwise ``(Replicate(), _StridedShard(0, sf=2), Shard(0))``,
  rowwise ``(Replicate(), Shard(0), Shard(1))``. Stepped with ``owners="auto"`` (each replica
  orthogonalizes the experts it holds whole) and with ``owners="mesh"`` (once in the world).
- ``tp2``: dp_shard 2, tp 2, no EP: experts tensor-parallel, ``(fsdp 2, tp 2)``: ``w1``/``w3``
  ``(Shard(0), Shard(1))``, ``w2`` ``(Shard(0), Shard(2))`` (``expert_param_placement_dense``).

Not run: the default ``spmd_backend="spmd_types"``. There ``Module.parallelize`` leaves plain
(annotated) tensors and torchtitan hands ``fully_shard`` a ``dp_mesh_dims``, which torch 2.13's
``fully_shard`` refuses ("When dp_mesh_dims is provided, all parameters must be DTensors",
torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharding_spec``), on CPU and GPU alike.
Two things are patched in the ranks so torchtitan runs on CPU: ``torchtitan.models`` imports
``torchtitan.distributed.minimal_async_ep``, whose kernels import triton (CUDA symmetric memory, not
on this path), so a stub module whose functions raise stands in for it; and ParallelDims builds its
meshes on ``tools.utils.device_type``, which is "cuda" when no accelerator is found, so it is set to
"cpu" for the build.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muon_dtensor import Muon
from tests.harness import background
from tests.harness.ranks import run_apart
from tests.helpers.models import dt, full_state
from tests.helpers.stage_layouts import gradient, train

needs_titan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"
)
STEPS, DENSE = 3, 15  # Muon matrices outside the experts: 4 + 3 (layer 0) + 4 + 1 + 3 (layer 1)
EXPERTS = r"moe.routed_experts.inner_experts."
ADAMW = ("tok_embeddings", "lm_head", "norm")


class Layout(NamedTuple):
    backend: str
    dp_shard: int
    tp: int
    ep: int
    experts: int
    dp_replicate: int = 1
    owners: str = "auto"  # Muon(owners=...): where HSDP parameters find their owners


LAYOUTS = {
    "ep2": Layout("partial_dtensor", 4, 1, 2, 4),
    "ep2_shard1": Layout("partial_dtensor", 4, 1, 2, 2),
    "ep2_full_dtensor": Layout("full_dtensor", 4, 1, 2, 4),
    "ep2_tp2": Layout("partial_dtensor", 2, 2, 2, 4),
    "tp2": Layout("partial_dtensor", 2, 2, 1, 4),
    "hsdp2_ep2_tp2": Layout("partial_dtensor", 1, 2, 2, 4, dp_replicate=2),
    "hsdp2_ep2_tp2_mesh_owners": Layout("partial_dtensor", 1, 2, 2, 4, dp_replicate=2, owners="mesh"),
}
STRIDED_EP = ("efsdp", "ep"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
# layout -> parameter (FQN tail) -> (mesh axes, placements), torchtitan's, recorded above
PLACEMENTS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "ep2": {"w1_EFD": STRIDED_EP, "w2_EDF": STRIDED_EP, "gate.weight": (("fsdp",), "(Shard(dim=0),)")},
    "ep2_shard1": {"w2_EDF": (("efsdp", "ep"), "(Shard(dim=1), Shard(dim=0))")},
    "ep2_full_dtensor": {
        "w3_EFD": STRIDED_EP,
        "shared_experts.w2.weight": (("dp_shard",), "(Shard(dim=0),)"),
    },
    "ep2_tp2": {
        "w1_EFD": STRIDED_EP,
        "shared_experts.w1.weight": (("fsdp", "tp"), "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
        "feed_forward.w2.weight": (("fsdp", "tp"), "(Shard(dim=0), Shard(dim=1))"),
        "gate.weight": (("fsdp", "tp"), "(Shard(dim=0), Replicate())"),
    },
    "hsdp2_ep2_tp2": {
        "w1_EFD": (
            ("dp_replicate", "efsdp", "ep"),
            "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",
        ),
        "feed_forward.w1.weight": (
            ("dp_replicate", "fsdp", "tp"),
            "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",
        ),
        "1.attention.wo.weight": (
            ("dp_replicate", "fsdp", "tp"),
            "(Replicate(), Shard(dim=0), Shard(dim=1))",
        ),
    },
    "tp2": {
        "w1_EFD": (("fsdp", "tp"), "(Shard(dim=0), Shard(dim=1))"),
        "w2_EDF": (("fsdp", "tp"), "(Shard(dim=0), Shard(dim=2))"),
    },
}

PLACEMENTS["hsdp2_ep2_tp2_mesh_owners"] = PLACEMENTS["hsdp2_ep2_tp2"]


def _stub_cuda_only_module() -> None:
    """``torchtitan.distributed.minimal_async_ep`` imports triton at load time (its kernels drive CUDA
    symmetric memory); token_dispatcher.py imports five names from it. Stand in for it with functions
    that raise, so ``torchtitan.models`` imports on CPU; nothing here calls them."""
    name = "torchtitan.distributed.minimal_async_ep"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)

    def cuda_only(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("minimal_async_ep needs CUDA and triton")

    for fn in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
        setattr(stub, fn, cuda_only)
    stub.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})  # type: ignore[attr-defined]
    sys.modules[name] = stub


def titan_model(experts: int, ep: int = 1) -> nn.Module:
    """DeepSeek-V3's layers from torchtitan's own builder (its debug model's recipe, tiny dims: a
    dense layer then an MoE layer with one shared expert), every parameter seeded by FQN, with the
    sharding configs ``DeepSeekV3Model.Config.update_from_config`` sets (sequence parallel on, as
    torchtitan's default)."""
    _stub_cuda_only_module()
    from torchtitan.models.common import Embedding, Linear, RMSNorm  # type: ignore[import-untyped]
    from torchtitan.models.common.rope import ComplexRoPE  # type: ignore[import-untyped]
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers  # type: ignore[import-untyped]
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config  # type: ignore[import-untyped]

    dim, vocab = 8, 16
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=2, q_lora_rank=0, kv_lora_rank=4,
        qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, mscale=0.7, dense_hidden_dim=12,
        moe_hidden_dim=6, num_experts=experts, num_shared_experts=1, router_top_k=2,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=2, max_seq_len=16, theta=1e4),
    )  # fmt: skip
    config = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim, layers=layers, norm=RMSNorm.Config(normalized_shape=dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
    )  # fmt: skip
    set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=ep > 1)
    model = config.build()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(gradient("weight " + name, tuple(p.shape), 0) / 4)
    return model


@contextlib.contextmanager
def _titan_on_cpu(backend: str) -> Iterator[None]:
    """ParallelDims builds meshes on ``tools.utils.device_type`` ("cuda" with no accelerator);
    torchtitan's runtime helpers read the backend the trainer sets (trainer.py ``set_spmd_backend``).
    Both are module globals in a pooled rank: set for the build, restored after."""
    import torchtitan.distributed.parallel_dims as parallel_dims  # type: ignore[import-untyped]
    import torchtitan.distributed.utils as dist_utils  # type: ignore[import-untyped]

    saved = parallel_dims.device_type, dist_utils.get_spmd_backend()
    parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend(backend)
    try:
        yield
    finally:
        parallel_dims.device_type = saved[0]
        dist_utils.set_spmd_backend(saved[1])


def parallelize(layout: Layout) -> nn.Module:
    """This rank's model, parallelized by torchtitan's ``parallelize_deepseekv3``, as its trainer
    calls it (model config sharding set as ``DeepSeekV3Model.Config.update_from_config`` sets it)."""
    model = titan_model(layout.experts, layout.ep)
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # type: ignore[import-untyped]
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3  # type: ignore[import-untyped]

    parallelism = ParallelismConfig(
        data_parallel_shard_degree=layout.dp_shard, data_parallel_replicate_degree=layout.dp_replicate,
        tensor_parallel_degree=layout.tp, expert_parallel_degree=layout.ep, spmd_backend=layout.backend,
    )  # fmt: skip
    with _titan_on_cpu(layout.backend):
        dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        parallelize_deepseekv3(
            model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
        )  # fmt: skip
    return model


def muon(model: nn.Module, owners: str = "auto") -> Muon:
    """One Muon: the matrices, the expert stacks as E matrices each, AdamW for the rest."""
    named = list(model.named_parameters())
    experts = [(n, p) for n, p in named if EXPERTS in n]
    adamw = [(n, p) for n, p in named if p.ndim == 1 or n.split(".")[0] in ADAMW]
    matrices = [(n, p) for n, p in named if (n, p) not in experts + adamw]
    groups: list[dict[str, Any]] = [
        {"params": matrices},
        {"params": experts, "experts": True},
        {"params": adamw, "algorithm": "adamw"},
    ]
    return Muon(
        groups,
        lr=0.02,
        owners=owners,  # type: ignore[arg-type]
    )


def placements(model: nn.Module) -> dict[str, tuple[tuple[str, ...], str]]:
    out = {}
    for name, p in model.named_parameters():
        d = dt(p)  # every parameter is a DTensor once torchtitan's FSDP has run
        out[name] = (tuple(d.device_mesh.mesh_dim_names or ()), str(tuple(d.placements)))
    return out


@functools.cache
def reference(experts: int) -> dict[str, torch.Tensor]:
    """One process: the same model and gradients, plain tensors."""
    model = titan_model(experts)
    opt = muon(model)
    train(model, opt, range(STEPS))
    return {k: v.clone() for k, v in full_state(model, opt).items()}


def titan_runs() -> dict[str, Any]:
    """Every layout in turn on this rank, on a pool of its own (``run_apart``): after a task of the
    session's pooled ranks has parallelized, the next task's ``fully_shard`` fails ("Expected param's
    DTensor mesh to be the same mesh passed to fully_shard") on meshes torch kept from the first;
    in one task, one layout after another is fine. Per layout: placements, the state after the steps
    (rank 0 only), the matrices orthogonalized in the world (summed over ranks)."""
    out: dict[str, Any] = {}
    for key, layout in LAYOUTS.items():
        model = parallelize(layout)
        opt = muon(model, layout.owners)
        train(model, opt, range(STEPS))
        state = {k: v.clone() for k, v in full_state(model, opt).items()}
        done = torch.tensor([opt.comm_stats.orthogonalized])
        dist.all_reduce(done)
        out[key] = {
            "placements": placements(model),
            "state": state if dist.get_rank() == 0 else None,
            "orthogonalized": int(done),
        }
    return out


@background.job("titan_moe_runs")
def _in_background(folder: Path) -> list[dict[str, Any]]:
    """``titan_runs`` on 4 ranks of a pool of their own, beside the session's tests
    (tests/harness/background.py, ``run_apart``)."""
    return run_apart(titan_runs, 4, timeout=240)


@pytest.fixture
def titan_moe_runs() -> list[dict[str, Any]]:
    return background.result("titan_moe_runs")


@needs_titan
@pytest.mark.integration
def test_torchtitan_moe_layouts_step_as_one_process(titan_moe_runs: list[dict[str, Any]]) -> None:
    results = titan_moe_runs
    for key, layout in LAYOUTS.items():
        got = results[0][key]
        for tail, expected in PLACEMENTS[key].items():
            [name] = [n for n in got["placements"] if n.endswith(tail)]
            assert got["placements"][name] == expected, (key, name)
        assert [r[key]["placements"] for r in results] == [got["placements"]] * 4, key
        ref = reference(layout.experts)
        assert got["state"].keys() == ref.keys(), key
        assert [k for k in ref if not torch.equal(got["state"][k], ref[k])] == [], key
        assert got["orthogonalized"] == STEPS * orthogonalized(layout), (key, got["orthogonalized"])


def orthogonalized(layout: Layout) -> int:
    """Matrices orthogonalized in the world per step: each dense matrix and each expert of the 3
    stacks once; but with replicas and ``owners="auto"`` each replica orthogonalizes the experts it
    holds whole (no bytes between replicas: the cost model's choice, optim/policy.py)."""
    per_replica = layout.dp_replicate > 1 and layout.owners == "auto"
    return DENSE + 3 * layout.experts * (layout.dp_replicate if per_replica else 1)
