"""torchtitan's own parts, built from its configs as ``Trainer.__init__`` builds them, with this Muon
(issue 51): the block in docs/torchtitan.md ("On CPU") is run as written. torchtitan's Llama 3 debug
model, its ``parallelize_fn`` (FSDP2, HSDP), the optimizer container from ``muon_optimizer_config``,
its schedulers and its ``CheckpointManager``; on the fake backend at 64 ranks and on 2 gloo ranks.

Found by running it: the example's default pattern missed torchtitan 0.3.0's fused
``attention.qkv_linear.wqkv``, which went to AdamW; the test pins the 30 matrices Muon must get.
``Muon`` built by hand over this model's matrices names its embedding and head (the warning)."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from muon_dtensor import Muon, WrongMatrixWarning
from tests.harness import background
from tests.harness.ranks import run_apart
from tests.helpers.host import ns_dtype_here
from tests.helpers.models import distribute_like, full

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"),
]
ROOT = Path(__file__).resolve().parents[2]
MATRIX = re.compile(
    r"^layers\.\d+\.(attention\.qkv_linear\.wqkv|attention\.wo|feed_forward\.w[123])\.weight$"
)


def doc_block() -> str:
    """The first ``py`` block of docs/torchtitan.md's "On CPU" section."""
    text = (ROOT / "docs" / "torchtitan.md").read_text()
    section = text.split("### On CPU", 1)[1]
    return section.split("```py\n", 1)[1].split("\n```", 1)[0]


def build(replicas: int, folder: str, seed: int = 0) -> dict[str, Any]:
    """The doc's block run in a fresh namespace (``replicas``, ``folder`` are its two inputs)."""
    import sys

    import torchtitan.distributed.parallel_dims as parallel_dims  # type: ignore[import-untyped]
    import torchtitan.distributed.utils as dist_utils  # type: ignore[import-untyped]

    sys.path.insert(0, str(ROOT / "examples" / "torchtitan"))
    device_type, backend = parallel_dims.device_type, dist_utils.get_spmd_backend()
    torch.manual_seed(seed)
    namespace: dict[str, Any] = {"replicas": replicas, "folder": folder}
    try:
        exec(compile(doc_block(), "docs/torchtitan.md", "exec"), namespace)
    finally:  # the block sets both module globals: put them back for the other tests
        parallel_dims.device_type = device_type
        dist_utils.set_spmd_backend(backend)
        sys.path.remove(str(ROOT / "examples" / "torchtitan"))
    return namespace


def groups(optimizers: Any) -> dict[str, list[str]]:
    (opt,) = optimizers.optimizers
    return {g["algorithm"]: list(g["param_names"]) for g in opt.param_groups}


@pytest.mark.parametrize("replicas", [1, 2], ids=["fsdp64", "hsdp2x32"])
def test_fake_backend_64_ranks(replicas: int, tmp_path: Path) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    try:
        built = build(replicas, str(tmp_path))
        model, optimizers = built["model"], built["optimizers"]
        names = [n for n, _ in model.named_parameters()]
        assert groups(optimizers)["muon"] == [n for n in names if MATRIX.match(n)]
        assert len(groups(optimizers)["muon"]) == 30
        assert {"tok_embeddings.weight", "norm.weight", "lm_head.weight"} <= set(groups(optimizers)["adamw"])
        want = (Shard(0),) if replicas == 1 else (Replicate(), Shard(0))
        assert all(isinstance(p, DTensor) and tuple(p.placements) == want for p in model.parameters())
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.ones_like(p.to_local()), p.device_mesh, p.placements)
        optimizers.step()
        (opt,) = optimizers.optimizers
        buffers = [opt.state[p]["momentum_buffer"] for p in opt.param_groups[0]["params"]]
        assert all(isinstance(b, DTensor) and tuple(b.placements) == want for b in buffers)
    finally:
        dist.destroy_process_group()


def _grad(name: str, shape: torch.Size, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 7919 + sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def _step(model: Any, optimizers: Any, step: int) -> None:
    for name, p in model.named_parameters():
        p.grad = distribute_like(p, _grad(name, p.shape, step))
    optimizers.step()
    optimizers.zero_grad()


def _snapshot(model: Any, optimizers: Any) -> dict[str, torch.Tensor]:
    (opt,) = optimizers.optimizers
    out = {n: full(p.detach()) for n, p in model.named_parameters()}
    out.update({f"{n}:{k}": full(v) for n, p in model.named_parameters() for k, v in opt.state[p].items()})
    return out


def _set_ns_dtype(optimizers: Any, ns_dtype: torch.dtype) -> None:
    for group in optimizers.optimizers[0].param_groups:
        if group["algorithm"] == "muon":
            group["ns_dtype"] = ns_dtype


def _two_gloo_ranks(folder: str, ns_dtype: torch.dtype) -> list[str]:
    """Two steps through the doc's build on 2 ranks, against one process stepping the same gradients
    on torchtitan's unsharded model; a save through the checkpointer, loaded into another build.
    Newton-Schulz runs in ``ns_dtype`` in both (set on the group after the build)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # type: ignore[import-untyped]
    from torchtitan.models.llama3 import model_registry  # type: ignore[import-untyped]

    from examples.torchtitan.muon_optimizer import muon_optimizer_config

    built = build(1, folder)
    model, optimizers, checkpointer = built["model"], built["optimizers"], built["checkpointer"]
    reference = model_registry("debugmodel").model.build()  # one process, same weights
    reference.load_state_dict({n: full(p.detach()) for n, p in model.named_parameters()}, strict=False)
    ref_opt = muon_optimizer_config(lr=0.02, adamw_lr=8e-4).build(model_parts=[reference])
    LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=ref_opt, training_steps=10)
    _set_ns_dtype(optimizers, ns_dtype)
    _set_ns_dtype(ref_opt, ns_dtype)
    for step in range(2):
        _step(model, optimizers, step)
        _step(reference, ref_opt, step)
    mine, ref = _snapshot(model, optimizers), _snapshot(reference, ref_opt)
    problems = [f"differs from one process: {k}" for k in ref if not torch.equal(mine[k], ref[k])]
    problems += [] if mine.keys() == ref.keys() else ["other entries than one process"]
    checkpointer.save(curr_step=2)
    again = build(1, folder, seed=1)
    again["checkpointer"].load(step=2)
    loaded = _snapshot(again["model"], again["optimizers"])
    problems += [f"not restored: {k}" for k in mine if not torch.equal(loaded[k], mine[k])]
    return problems + ([] if len(mine) > 45 else [f"only {len(mine)} entries"])


@background.job("titan_two_gloo_ranks")
def _titan_two_gloo_ranks(folder: Path) -> list[Any]:
    return run_apart(_two_gloo_ranks, 2, str(folder), ns_dtype_here(), timeout=300)


titan_two_gloo_ranks = background.reader("titan_two_gloo_ranks")


@pytest.mark.slow  # three builds and two steps per rank
def test_two_gloo_ranks_bitwise_and_checkpointed(titan_two_gloo_ranks: list[Any]) -> None:
    """Newton-Schulz in the library's default bf16, or in float32 where AVX2 emulates bf16 (each rank
    orthogonalizes 94 GFLOP in two steps of its own and of the reference: 60 s there in bf16). On a
    pool of its own beside the session's tests (``background.apart``)."""
    assert titan_two_gloo_ranks == [[], []]


def test_wrong_matrix_warning_on_torchtitan_llama() -> None:
    from torchtitan.models.llama3 import model_registry

    model = model_registry("debugmodel").model.build()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="2D parameters"):  # its norms: the error that follows
            Muon(model.parameters())  # the model is known: by module type
        Muon([(n, p) for n, p in model.named_parameters() if p.ndim == 2])  # names only: by name
    typed, named = [str(w.message) for w in seen if issubclass(w.category, WrongMatrixWarning)]
    assert "tok_embeddings.weight (an nn.Embedding weight)" in typed
    assert "lm_head.weight (the output head)" in typed
    assert "tok_embeddings.weight (an embedding (by its name))" in named
    assert "lm_head.weight (the output head (by its name))" in named
    assert "layers." not in typed + named


def _py_blocks(section: str) -> list[str]:
    text = (ROOT / "docs" / "torchtitan.md").read_text().split(section, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```py\n(.*?)^```$", text, re.S | re.M)


def test_checkpoint_docs_imports_and_absolute_initial_load_path(tmp_path: Path) -> None:
    """The import lines and the ``initial_load_path`` block of "Checkpoints both ways" run as written;
    a relative path is torchtitan's ValueError, as the page says."""
    from torchtitan.components.checkpoint import CheckpointManager  # type: ignore[import-untyped]

    imports, config_block = _py_blocks("## Checkpoints both ways")
    namespace: dict[str, Any] = {"root": "relative/root"}
    exec(compile(imports, "docs/torchtitan.md", "exec"), {})
    exec(compile(config_block, "docs/torchtitan.md", "exec"), namespace)
    assert namespace["checkpoint"].initial_load_path == str(Path.cwd() / "relative/root/step_00000003")
    with pytest.raises(ValueError, match="initial_load_path must be an absolute path"):
        CheckpointManager.Config(enable=True, initial_load_path="relative/root/step_00000003")
