"""A steady step never waits for the device: no ``.item()``, ``.cpu()``, ``.tolist()``,
``bool()``/``float()``/``int()`` on a parameter's, gradient's or state's local tensor, on anything
computed from them, or on the exchange buffers; and the preflight's and agreement's integer sums
stay on the host (no ``.to(device)``/``.cpu()`` round trip) when the groups have a CPU backend.

On a CPU-only machine every tensor is on the host, so the check is by taint: a TorchFunctionMode
marks the step's device tensors (and every result computed from one, and every all-to-all buffer)
and records each host read of one, and every device move of any tensor. A second test pins a bug
the host path fixed: the preflight summed the same counts tensor in place over several meshes, so
a gradient missing on one rank of the second mesh went unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from muon_dtensor import Muon, split_params
from muon_dtensor.sharding.plan.param_layout import local_of
from tests.harness.ranks import RankError, run_ranks
from tests.helpers.models import build, dt, model_grads, step_together

T = torch.Tensor
HOST_READS = {T.item, T.tolist, T.numpy, T.__bool__, T.__float__, T.__int__, T.__index__}
DEVICE_MOVES = {T.cpu, T.cuda}


def _moves_device(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """``Tensor.to`` with a device argument (a dtype-only ``.to`` is a cast, not a move)."""
    if func is not T.to:
        return False
    values = [*args[1:], *kwargs.values()]
    return any(isinstance(v, (str, torch.device)) for v in values)


def _storage(t: T) -> int:
    """Where a tensor's data lives: views (``to_local()``, slices) of a device tensor share it."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


class SyncWatch(TorchFunctionMode):
    """Records host reads of device tensors and device moves of any tensor."""

    def __init__(self, device: list[T]) -> None:
        super().__init__()
        self.held: list[T] = []  # strong refs: a marked storage is never freed and reused
        self.device: set[int] = set()
        self.found: list[str] = []
        self.mark(device)

    def mark(self, *tensors: Any) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, T) and _storage(t):  # 0: no data at all (an empty shard)
                self.held.append(t)
                self.device.add(_storage(t))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, T)]
        tainted = any(_storage(t) in self.device for t in tensors)
        name = getattr(func, "__name__", str(func))
        if (tainted and func in HOST_READS) or func in DEVICE_MOVES or _moves_device(func, args, kwargs):
            self.found.append(name)
        out = func(*args, **kwargs)
        if tainted:
            self.mark(out)
        return out


def steady_step_reads() -> dict[str, Any]:
    model = build((dist.get_world_size(),))
    groups = split_params(model)
    opt = Muon(groups, lr=0.02)
    params = list(model.parameters())
    grads = model_grads(model, 40)
    step_together([(params, opt)], grads, range(2))  # build plans and state
    for p, g in zip(params, grads(2)):
        p.grad = distribute_tensor(g, dt(p).device_mesh, dt(p).placements)
    device = [local_of(t) for p in params for t in (p, dt(p.grad))]
    device += [local_of(v) for p in params for k, v in opt.state[p].items() if k != "step"]
    watch = SyncWatch(device)
    real = dist.all_to_all_single

    def all_to_all(out: T, inp: T, *a: Any, **k: Any) -> Any:
        watch.mark(out, inp)  # the exchange buffers are device tensors
        return real(out, inp, *a, **k)

    dist.all_to_all_single = all_to_all  # type: ignore[assignment]
    try:
        with watch:
            opt.step()
    finally:
        dist.all_to_all_single = real
    counters = [s["step"].device.type for s in opt.state.values() if "step" in s]
    return {"found": watch.found, "counters": counters, "adamw": len(counters)}


@pytest.mark.parametrize("world", [2])
def test_steady_step_reads_nothing_from_the_device(world: int) -> None:
    for r in run_ranks(steady_step_reads, world, timeout=120):
        assert r["found"] == [], r["found"]
        assert r["adamw"] > 0 and set(r["counters"]) == {"cpu"}, r  # AdamW's step counters stay on CPU


def grad_missing_on_second_mesh() -> str:
    first = init_device_mesh("cpu", (2,), mesh_dim_names=("first",))
    second = init_device_mesh("cpu", (2,), mesh_dim_names=("second",))
    torch.manual_seed(0)
    a = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), first, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), second, [Shard(0)]))
    opt = Muon([a, b], lr=0.02)
    a.grad = distribute_tensor(torch.randn(8, 4), first, [Shard(0)])
    b.grad = distribute_tensor(torch.randn(8, 4), second, [Shard(0)])
    if dist.get_rank() == 1:
        b.grad = None
    assert isinstance(a, DTensor)
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_gradient_missing_on_one_rank_of_a_second_mesh_fails_everywhere() -> None:
    try:
        results = run_ranks(grad_missing_on_second_mesh, 2, timeout=60)
    except RankError as e:  # a rank that stepped alone would hang or fail differently
        pytest.fail(f"ranks did not fail together: {e}")
    for text in results:
        assert "has a gradient on 1 of 2 rank(s)" in text, text


def test_a_group_without_a_cpu_backend_is_told_apart() -> None:
    """Plain "nccl" serves CUDA only: such a group's sums take the device path (and warn once)."""
    from types import SimpleNamespace

    from muon_dtensor.base.compat import has_cpu_backend

    assert has_cpu_backend(SimpleNamespace(_device_types=[torch.device("cuda"), torch.device("cpu")]))  # type: ignore[arg-type]
    assert not has_cpu_backend(SimpleNamespace(_device_types=[torch.device("cuda")]))  # type: ignore[arg-type]
    assert not has_cpu_backend(SimpleNamespace())  # type: ignore[arg-type]
