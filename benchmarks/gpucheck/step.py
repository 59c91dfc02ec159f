"""(c) One-GPU step, world size 1: muon_dtensor.Muon, torch.optim.Muon and fused AdamW, and
muon_dtensor.Muon with bf16 and int8 momentum and with ``ns_algorithm="aol"`` (``VARIANTS``).

``Settings.layers`` Llama-shaped layers (q, o, k, v, gate, up, down as ``nn.Linear`` without bias),
fp32 weights, seeded random gradients set once. Each contender steps its own copy of the model:
``warmup`` steps, one step under ``torch.profiler`` (top-level ``aten::`` ops counted as
benchmarks/bench_host.py counts them, and on CUDA the kernels' summed device time), then
``step_reps`` timed steps, each started on an idle device: ``host_ms`` is ``time.perf_counter``
around ``opt.step()`` without a sync (the Python step's own time), ``wall_ms`` the same with a sync
after, ``device_ms`` CUDA events around the step (its time on the stream, idle gaps included) and
``kernel_ms`` the profiled step's device events summed (the device's busy time). Host time / ops
is set against the cost model's host figure (``Hardware.h200().op_overhead``, 5 us per eager op).
On CUDA ``peak_mib_over_model``: the most memory allocated during the contender's steps above what
its model and gradients held before its first step (its state and the step's transients). Last,
one steady step under ``torch.cuda.set_sync_debug_mode("error")``: does it wait for the
device?
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType

from benchmarks.gpucheck.common import Dims, Settings, clock, error_text, median, sync
from muon_dtensor import Muon, split_params
from muon_dtensor.base.op_count import top_level_ops
from muon_dtensor.numerics.newton_schulz import ns_flops
from muon_dtensor.planning.hardware import Hardware

# muon_dtensor.Muon as the step runs it with the other momentum dtypes and Newton-Schulz algorithm.
VARIANTS: dict[str, dict[str, Any]] = {
    "muon_dtensor.Muon bf16 momentum": {"momentum_dtype": torch.bfloat16},
    "muon_dtensor.Muon int8 momentum": {"momentum_dtype": torch.int8},
    'muon_dtensor.Muon ns_algorithm="aol"': {"ns_algorithm": "aol"},
}
CONTENDERS = ("muon_dtensor.Muon", "torch.optim.Muon", "torch.optim.AdamW fused", *VARIANTS)
LR, WEIGHT_DECAY = 0.02, 0.1


class Layer(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        w, kv, ffn = dims.width, dims.kv, dims.ffn
        self.q, self.o = nn.Linear(w, w, bias=False), nn.Linear(w, w, bias=False)
        self.k, self.v = nn.Linear(w, kv, bias=False), nn.Linear(w, kv, bias=False)
        self.gate, self.up = nn.Linear(w, ffn, bias=False), nn.Linear(w, ffn, bias=False)
        self.down = nn.Linear(ffn, w, bias=False)


class Model(nn.Module):
    def __init__(self, layers: int, dims: Dims) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(dims) for _ in range(layers)])


def make_model(layers: int, dims: Dims, device: torch.device, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    with torch.device(device):
        return Model(layers, dims)


def seed_grads(model: nn.Module, seed: int) -> None:
    """A random gradient (never zeros) for every parameter, from ``seed``."""
    params = list(model.parameters())
    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)


def copy_model(base: nn.Module) -> nn.Module:
    """A deep copy of ``base`` with its gradients (``deepcopy`` leaves a parameter's ``.grad`` out)."""
    model = copy.deepcopy(base)
    for p, q in zip(model.parameters(), base.parameters()):
        p.grad = None if q.grad is None else q.grad.clone()
    return model


def make_optimizer(
    label: str, model: nn.Module, lr: float | torch.Tensor = LR, capturable: bool = False
) -> torch.optim.Optimizer:
    if label == "muon_dtensor.Muon" or label in VARIANTS:
        options = VARIANTS.get(label, {})
        return Muon(split_params(model), lr=lr, weight_decay=WEIGHT_DECAY, capturable=capturable, **options)
    if label == "torch.optim.Muon":
        return torch.optim.Muon(model.parameters(), lr=float(lr), weight_decay=WEIGHT_DECAY)
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=WEIGHT_DECAY, fused=True)


def count_ops(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One call of ``step`` under the profiler: top-level ``aten::`` ops, and on CUDA the device
    events' count and summed time (the device's busy time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    ops = [name for name in top_level_ops(prof) if name.startswith("aten::")]
    top = sorted(set(ops), key=ops.count, reverse=True)[:12]
    out: dict[str, Any] = {"ops": len(ops), "top_op_names": {n: ops.count(n) for n in top}}
    if device.type == "cuda":  # device events (kernels, copies) once each, not again via their ops
        kernels = [e for e in prof.profiler.function_events if e.device_type == DeviceType.CUDA]
        out["kernels"] = len(kernels)
        out["kernel_ms"] = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
    return out


def time_steps(step: Callable[[], Any], reps: int, device: torch.device) -> dict[str, Any]:
    """``reps`` calls, each on an idle device: host ms (no sync), wall ms (synced), event ms."""
    host, wall, events = [], [], []
    cuda = device.type == "cuda"
    for _ in range(reps):
        sync(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        t0 = time.perf_counter()
        if cuda:
            marks[0].record()
        step()
        t1 = time.perf_counter()
        if cuda:
            marks[1].record()
        sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
        if cuda:
            events.append(marks[0].elapsed_time(marks[1]))
    return {
        "host_ms": median(host),
        "wall_ms": median(wall),
        "device_ms": median(events),
        "host_ms_all": host,
        "wall_ms_all": wall,
        "device_ms_all": events,
    }


def sync_check(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One call under ``set_sync_debug_mode("error")``: does it synchronize with the host?"""
    if device.type != "cuda":
        return {"skipped": "torch.cuda.set_sync_debug_mode needs CUDA"}
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return {"syncs": False}
    except RuntimeError as exc:
        return {"syncs": True, "error": error_text(exc)}
    finally:
        torch.cuda.set_sync_debug_mode(0)


def measure(label: str, base: nn.Module, settings: Settings) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One contender on its own copy of ``base``: first step, ops, timed steps, sync check; and
    its parameters after the timed steps."""
    model = copy_model(base)
    opt = make_optimizer(label, model)
    sync(settings.device)
    if settings.cuda:
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    opt.step()
    sync(settings.device)
    row: dict[str, Any] = {"first_step_ms": (time.perf_counter() - t0) * 1e3}
    for _ in range(settings.warmup - 1):
        opt.step()
    row |= count_ops(opt.step, settings.device)
    row |= time_steps(opt.step, settings.step_reps, settings.device)
    row["steps"] = settings.warmup + 1 + settings.step_reps
    row["host_us_per_op"] = row["host_ms"] * 1e3 / row["ops"] if row["ops"] else None
    if settings.cuda:  # the optimizer's state and its step's transients, over the model and grads
        row["peak_mib_over_model"] = (torch.cuda.max_memory_allocated() - resident) / 2**20
    snapshot = [p.detach().clone() for p in model.parameters()]
    row["sync_check"] = sync_check(opt.step, settings.device)
    return row, snapshot


def part_c(settings: Settings) -> dict[str, Any]:
    base = make_model(settings.layers, settings.dims, settings.device)
    seed_grads(base, 1)
    shapes = [tuple(p.shape) for p in base.parameters()]
    rows: dict[str, Any] = {}
    params: dict[str, list[torch.Tensor]] = {}
    for label in CONTENDERS:
        try:
            rows[label], params[label] = measure(label, base, settings)
        except Exception as exc:  # noqa: BLE001 - one contender's failure is recorded
            rows[label] = {"error": error_text(exc)}
        if settings.cuda:
            torch.cuda.empty_cache()
    out: dict[str, Any] = {
        "layers": settings.layers,
        "matrices": [list(s) for s in shapes],
        "ns_flops_per_step": sum(ns_flops(s, 5) for s in shapes),
        "clock": clock(settings.device),
        "host_model_us_per_op": Hardware.h200().op_overhead * 1e6,
        "contenders": rows,
    }
    mine, theirs = params.get(CONTENDERS[0]), params.get(CONTENDERS[1])
    if mine and theirs:
        diff = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
        out["muon_vs_torch_muon_max_abs_param_diff"] = diff
    for label in VARIANTS:  # how far each variant's parameters land from float32 momentum's
        if mine and params.get(label):
            diff = max((a - b).abs().max().item() for a, b in zip(mine, params[label]))
            rows[label]["max_abs_param_diff_to_float32_momentum"] = diff
    return out
