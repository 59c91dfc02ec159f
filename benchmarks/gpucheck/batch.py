"""(a) Batch independence of Newton-Schulz bits.

For each shape, one random bf16 matrix ``x`` is orthogonalized alone (``orthogonalize([x])``: the
2-D ``mm``/``addmm`` path, what ``MUON_DTENSOR_NS_BATCH=never`` and the CPU path run) and twice more:
alone again (is the lone result repeatable?) and as a batch of one (``bmm``). Then it is placed
first, in the middle and last of random batches of each size, one ``newton_schulz`` call on the
``[B, m, n]`` stack each (what ``orthogonalize`` runs on CUDA by default), and every copy's result is
compared with the lone one and with the first copy in the smallest batch. Last, the same matrix
through ``torch.optim._muon``'s ``_zeropower_via_newtonschulz``. Stacks over
``Settings.max_stack_bytes`` are skipped (Newton-Schulz holds about three stacks of that size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpucheck.common import Settings, Shape, compare, error_text
from muon_dtensor import DEFAULT_COEFFICIENTS, NSConfig, newton_schulz, orthogonalize, resolve_ns_config
from muon_dtensor.numerics.newton_schulz import BATCH_ENV, batching

NS_STEPS, EPS = 5, 1e-7
POSITIONS = ("first", "middle", "last")


def default_config() -> NSConfig:
    """The optimizer's default Newton-Schulz: Keller's triple, 5 steps, bf16, standard."""
    return resolve_ns_config(DEFAULT_COEFFICIENTS, NS_STEPS, EPS)


def torch_zeropower() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """torch.optim.Muon's Newton-Schulz function, or None and why not."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError as exc:
        return None, f"torch.optim._muon._zeropower_via_newtonschulz is not importable: {exc}"
    return _zeropower_via_newtonschulz, "torch.optim._muon._zeropower_via_newtonschulz"


def timed_call(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float | None]:
    """One call's result and its CUDA-event milliseconds (None on CPU)."""
    if device.type != "cuda":
        return fn(), None
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    stop.record()
    stop.synchronize()
    return out, start.elapsed_time(stop)


def positions(batch: int) -> dict[str, int]:
    """Index of each position name in a batch (a batch of 2 has no middle of its own)."""
    return dict(zip(POSITIONS, (0, batch // 2, batch - 1)))


def batch_rows(
    x: torch.Tensor, lone: torch.Tensor, settings: Settings, config: NSConfig, gen: torch.Generator
) -> dict[str, Any]:
    """Per batch size: each position's result against the lone one and the smallest batch's."""
    rows: dict[str, Any] = {}
    reference: torch.Tensor | None = None
    for b in settings.a_batches:
        if b * x.numel() * x.element_size() > settings.max_stack_bytes:
            rows[str(b)] = {"skipped": f"stack over {settings.max_stack_bytes / 2**30:.0f} GiB"}
            continue
        stack = torch.randn(b, *x.shape, generator=gen, device=x.device, dtype=x.dtype)
        where = positions(b)
        for i in set(where.values()):
            stack[i].copy_(x)
        out, ms = timed_call(functools.partial(newton_schulz, stack, config), x.device)
        if reference is None:
            reference = out[0].clone()
        rows[str(b)] = {
            "vs_lone": {name: compare(lone, out[i]) for name, i in where.items()},
            "vs_smallest_batch": {name: torch.equal(reference, out[i]) for name, i in where.items()},
            "call_ms": ms,
        }
        del stack, out
    return rows


def check_shape(shape: Shape, settings: Settings, config: NSConfig, seed: int) -> dict[str, Any]:
    """One shape's row: lone repeat, batch of one, every batch size and position, torch's path."""
    gen = torch.Generator(device=settings.device).manual_seed(seed)
    x = torch.randn(shape, generator=gen, device=settings.device, dtype=torch.bfloat16)
    lone = orthogonalize([x], config)[0]
    repeat, lone_ms = timed_call(lambda: orthogonalize([x], config)[0], settings.device)
    row: dict[str, Any] = {"shape": list(shape), "lone_ms": lone_ms, "repeat": compare(lone, repeat)}
    row["batch_of_1_bmm"] = compare(lone, newton_schulz(x[None], config)[0])
    row["batches"] = batch_rows(x, lone, settings, config, gen)
    zeropower, what = torch_zeropower()
    if zeropower is None:
        row["torch_optim_muon"] = {"skipped": what}
    else:
        theirs = zeropower(x.clone(), DEFAULT_COEFFICIENTS, NS_STEPS, EPS)  # it divides in place
        row["torch_optim_muon"] = compare(lone, theirs) | {"tall": shape[0] > shape[1]}
    row["batch_independent"] = all_equal(row)
    return row


def all_equal(row: dict[str, Any]) -> bool:
    """Every batched result of the row equals the lone one, bit for bit."""
    checks = [row["repeat"]["equal"], row["batch_of_1_bmm"]["equal"]]
    for entry in row["batches"].values():
        checks += [c["equal"] for c in entry.get("vs_lone", {}).values()]
    return all(checks)


def part_a(settings: Settings) -> dict[str, Any]:
    """Every shape of ``settings.a_shapes``; a shape that fails records its error."""
    config = default_config()
    rows: dict[str, Any] = {}
    for seed, (label, shape) in enumerate(settings.a_shapes.items()):
        if settings.left_s() < 20:
            rows[label] = {"skipped": "--budget-s spent"}
            continue
        try:
            rows[label] = check_shape(shape, settings, config, seed)
        except Exception as exc:  # noqa: BLE001 - one shape's failure is recorded, the rest run
            rows[label] = {"shape": list(shape), "error": error_text(exc)}
        if settings.cuda:
            torch.cuda.empty_cache()
    done = [r for r in rows.values() if "batch_independent" in r]
    return {
        "config": {"coefficients": list(config.coefficients), "steps": NS_STEPS, "dtype": "bfloat16"},
        "batches": list(settings.a_batches),
        "library_batches_here": batching(settings.device.type),
        "batch_env": BATCH_ENV,
        "torch_path": torch_zeropower()[1],
        "rows": rows,
        "shapes_checked": len(done),
        "shapes_batch_independent": sum(r["batch_independent"] for r in done),
        "torch_equal_shapes": sum(r["torch_optim_muon"].get("equal", False) for r in done),
    }
