"""``qk_clip_all_``: every layer's QK-Clip in one MAX all-reduce per mesh axis, bit for bit the
per-layer ``qk_clip_``; and ranks that disagree about a QK-Clip argument raise the same error on
every rank, naming the argument and both values, instead of aborting (gloo, a different
``head_dim``: buffers of different sizes) or silently clipping by different factors."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from muon_dtensor import QKClipFactors, qk_clip_, qk_clip_all_
from muon_dtensor.features.qk_clip import local_rows
from muon_dtensor.features.qk_logits import record_llama_logits
from tests.features.test_qk_clip import QK, _llama
from tests.harness.ranks import run_ranks

TIMEOUT = 120.0
# (query heads, key heads, head_dim, hidden) of the layers clipped together: head_dim 4 throughout;
# under 2-rank TP each splits into whole heads. The last one alone fills more than the first
# all-reduce (5,000 query heads), so its call takes a second one.
LAYERS = [(6, 2, 4, 10), (8, 4, 4, 10), (2, 2, 4, 6), (4, 1, 4, 10)]
BIG = (5000, 2, 1, 3)


@contextmanager
def counted() -> Iterator[list[int]]:
    """Counts torch.distributed.all_reduce calls (comm.py calls it through the module)."""
    calls = [0]
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counting):
        yield calls


def _model(shape: tuple[int, int, int, int], seed: int, layout: str, mesh: Any) -> QK:
    torch.manual_seed(seed)
    model = QK(*shape)
    if layout == "tp":
        parallelize_module(model, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    elif layout in ("fsdp", "hsdp"):  # a 2-D mesh makes fully_shard HSDP
        fully_shard(model, mesh=mesh)
    return model


def _logits(model: QK, head_dim: int, seed: int, layout: str) -> torch.Tensor:
    """This rank's max logits, 20 to 300 around tau = 100; -inf for heads it does not hold (TP)."""
    heads = model.q.weight.shape[0] // head_dim
    gen = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    values = 20 + 280 * torch.rand(heads, generator=gen)
    if layout == "tp":
        mine = set((local_rows(model.q.weight, "q") // head_dim).tolist())
        values[[h for h in range(heads) if h not in mine]] = -math.inf
    return values


def _build(layout: str, shapes: list[tuple[int, int, int, int]], mesh: Any) -> tuple[list[QK], list[Any]]:
    models = [_model(shape, seed, layout, mesh) for seed, shape in enumerate(shapes)]
    return models, [_logits(m, shape[2], seed, layout) for seed, (m, shape) in enumerate(zip(models, shapes))]


def _local(models: list[QK]) -> list[torch.Tensor]:
    return [
        (w.to_local() if isinstance(w, DTensor) else w).detach().clone()
        for m in models
        for w in (m.q.weight, m.k.weight)
    ]


def all_against_per_layer(layout: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """On every rank: the same layers twice; one copy clipped layer by layer, the other by one
    ``qk_clip_all_``; the local shards, the factors and the all-reduce counts."""
    names = {"fsdp": ("dp",), "tp": ("tp",), "hsdp": ("replicate", "shard")}[layout]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    out: dict[str, Any] = {"axes": sum(1 for a in range(mesh.ndim) if mesh.size(a) > 1)}
    for case, shapes in (("layers", LAYERS), ("big", [*LAYERS[:2], BIG])):
        per, logits = _build(layout, shapes, mesh)
        together, _ = _build(layout, shapes, mesh)
        with counted() as calls_per:
            one = [qk_clip_(m.q.weight, m.k.weight, v, head_dim=s[2]) for m, v, s in zip(per, logits, shapes)]
        head_dim = shapes[0][2] if case == "layers" else None
        with counted() as calls_all:
            if head_dim is not None:
                layers = {
                    f"block{i}": (m.q.weight, m.k.weight, v) for i, (m, v) in enumerate(zip(together, logits))
                }
                every = qk_clip_all_(layers, head_dim=head_dim)
            else:  # the big layer's head_dim differs: its own call
                every = qk_clip_all_(
                    [(m.q.weight, m.k.weight, v) for m, v in zip(together[:2], logits[:2])], head_dim=4
                )
                every += qk_clip_all_([(together[2].q.weight, together[2].k.weight, logits[2])], head_dim=1)
        out[case] = {
            "per_layer": _local(per), "all": _local(together), "factors_per_layer": one, "factors_all": every,
            "calls_per_layer": calls_per[0], "calls_all": calls_all[0],
        }  # fmt: skip
    for n in (1, 3, 8):  # the number of layers changes nothing in the count
        models, logits = _build(layout, [LAYERS[i % len(LAYERS)] for i in range(n)], mesh)
        with counted() as calls:
            qk_clip_all_(
                {f"b{i}": (m.q.weight, m.k.weight, v) for i, (m, v) in enumerate(zip(models, logits))},
                head_dim=4,
            )
        out[f"calls_{n}"] = calls[0]
    return out


CASES = [("fsdp", (2,)), ("tp", (2,)), ("hsdp", (2, 2))]


@pytest.mark.parametrize(("layout", "mesh_shape"), CASES, ids=[f"{a}{b}" for a, b in CASES])
def test_all_layers_equal_per_layer_calls_bitwise_in_one_all_reduce_per_axis(
    layout: str, mesh_shape: tuple[int, ...]
) -> None:
    results = run_ranks(all_against_per_layer, math.prod(mesh_shape), layout, mesh_shape, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        axes = r["axes"]
        assert axes == len(mesh_shape)
        for case in ("layers", "big"):
            c = r[case]
            for a, b in zip(c["per_layer"], c["all"]):
                assert torch.equal(a, b), (rank, case)
            clipped = False
            for f1, f2 in zip(c["factors_per_layer"], c["factors_all"], strict=True):
                assert isinstance(f2, QKClipFactors)
                assert all(torch.equal(x, y) for x, y in zip(f1, f2))
                clipped |= bool((f1.q < 1).any())
            assert clipped, "some heads clipped"
        # every call: one agreement sum over the default group, then one MAX per mesh axis
        assert r["layers"]["calls_per_layer"] == len(LAYERS) * (1 + axes)
        assert r["layers"]["calls_all"] == 1 + axes, "one all-reduce per mesh axis for every layer"
        # the big layer (5,000 heads) has a call of its own (another head_dim)
        assert r["big"]["calls_all"] == 2 * (1 + axes)
        assert r[f"calls_{1}"] == r[f"calls_{3}"] == r[f"calls_{8}"] == 1 + axes


def two_meshes() -> dict[str, Any]:
    """Plain layers (the default group) and FSDP layers (a mesh) in one call: one all-reduce each,
    after the agreement's one."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    fsdp, logits_a = _build("fsdp", LAYERS[:2], mesh)
    plain, logits_b = _build("plain", LAYERS[2:], mesh)
    layers = [(m.q.weight, m.k.weight, v) for m, v in zip(fsdp + plain, logits_a + logits_b)]
    with counted() as calls:
        qk_clip_all_(layers, head_dim=4)
    return {"calls": calls[0]}


def test_layers_on_two_scopes_take_one_all_reduce_each() -> None:
    assert [r["calls"] for r in run_ranks(two_meshes, 2, timeout=TIMEOUT)] == [3, 3]


# ------------------------------------------------------------------------------------- disagreement
def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    return "no error"


def disagreeing_calls(layout: str) -> dict[str, Any]:
    """Every rank passes its own value of one argument, to both calls; then a good call shows no
    rank was left behind in a collective."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    models, logits = _build(layout, LAYERS[:2], mesh)
    q, k, v = models[0].q.weight, models[0].k.weight, logits[0]
    both = {f"block{i}": (m.q.weight, m.k.weight, x) for i, (m, x) in enumerate(zip(models, logits))}
    mine = [3, 2] if rank else [2, 3]  # a rank's own shapes: only plain tensors can differ
    bad: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "head_dim": ({"head_dim": 4 if rank == 0 else 2}, both),
        "threshold": ({"head_dim": 4, "threshold": 100.0 if rank == 0 else 50.0}, both),
        "alpha": ({"head_dim": 4, "alpha": 0.5 if rank == 0 else 0.25}, both),
        "order": ({"head_dim": 4}, both if rank == 0 else dict(reversed(list(both.items())))),
        "layers": ({"head_dim": 4}, both if rank == 0 else {"block0": both["block0"]}),
    }
    before = _local(models)
    out: dict[str, Any] = {}
    for case, (kwargs, layers) in bad.items():
        out[f"all_{case}"] = _error(functools.partial(qk_clip_all_, layers, **kwargs))
        if case not in ("order", "layers"):
            out[f"one_{case}"] = _error(functools.partial(qk_clip_, q, k, v, **kwargs))
    if layout == "plain":
        shaped = torch.zeros(4 * mine[0], 10)
        out["one_shape"] = _error(
            lambda: qk_clip_(shaped, torch.zeros(4, 10), torch.zeros(mine[0]), head_dim=4)
        )
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _local(models)))
    out["then"] = [float(f.max_logits.max()) for f in qk_clip_all_(both, head_dim=4)]
    return out


EXPECTED = {  # case: what every rank's error says
    "head_dim": "ranks disagree about head_dim: 4 on rank 0, 2 on rank 1",
    "threshold": "ranks disagree about threshold: 100.0 on rank 0, 50.0 on rank 1",
    "alpha": "ranks disagree about alpha: 0.5 on rank 0, 0.25 on rank 1",
    "order": "ranks disagree about the layers: ('block0', 'block1') on rank 0, "
    "('block1', 'block0') on rank 1",
    "layers": "ranks disagree about the layers: ('block0', 'block1') on rank 0, ('block0',) on rank 1",
    "shape": "ranks disagree about q_weight: 'torch.float32 of shape (8, 10)' on rank 0, "
    "'torch.float32 of shape (12, 10)' on rank 1",
}


@pytest.mark.parametrize("layout", ["fsdp", "plain"])
def test_ranks_that_disagree_raise_the_same_error_naming_both_values(layout: str) -> None:
    results = run_ranks(disagreeing_calls, 2, layout, timeout=TIMEOUT)
    assert results[0]["then"] == results[1]["then"] and results[0]["unchanged"]
    cases = [k for k in results[0] if k.startswith(("all_", "one_"))]
    assert len(cases) == (9 if layout == "plain" else 8)
    for case in cases:
        call, what = case.split("_", 1)
        text = results[0][case]
        assert text == results[1][case], f"{case}: the ranks raised different errors"
        assert (
            text.startswith("qk_clip_all_: " if call == "all" else "qk_clip_: ") and EXPECTED[what] in text
        ), text
        assert "No weight changed" in text


# ------------------------------------------------------------------------------------- recorders
def test_llama_recorder_clips_every_layer_as_per_layer_calls() -> None:
    """``MaxLogits.clip_`` (Hugging Face Llama) equals ``qk_clip_`` layer by layer, bit for bit."""
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    llama, twin = _llama("eager"), _llama("eager")
    with record_llama_logits(llama) as rec:
        llama(ids)
    values = {n: v.clone() for n, v in rec.values.items()}
    tau = float(torch.cat(list(values.values())).median())
    done = rec.clip_(threshold=tau)
    assert list(done) == list(values) and any(bool((f.q < 1).any()) for f in done.values())
    modules = dict(twin.named_modules())
    for name, v in values.items():
        attn = modules[name]
        f = qk_clip_(attn.q_proj.weight, attn.k_proj.weight, v, head_dim=8, threshold=tau)
        assert all(torch.equal(x, y) for x, y in zip(f, done[name]))
    for (n, a), (_, b) in zip(llama.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def same_shapes_in_a_list() -> list[str]:
    """Two layers of the same shapes in a list: their order is all that tells them apart."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    models, logits = _build("fsdp", [LAYERS[0], LAYERS[0]], mesh)
    layers = [(m.q.weight, m.k.weight, v) for m, v in zip(models, logits)]
    if dist.get_rank() == 1:
        layers.reverse()  # swapped on one rank: each layer would be clipped with the other's logits
    return [_error(lambda: qk_clip_all_(layers, head_dim=4))]


def test_a_list_of_same_shape_layers_is_refused_on_every_rank() -> None:
    """Before: no error, one layer clipped with the other layer's logits. A list whose order cannot
    be checked across ranks is refused on every rank, naming the dict form (whose names are compared)."""
    first, second = run_ranks(same_shapes_in_a_list, 2, timeout=TIMEOUT)
    assert first[0] == second[0] and "layers 0 and 1 of the list have the same shapes" in first[0], first
    assert "pass a dict {name: (q_weight, k_weight, max_logits)}" in first[0]
