"""8-bit blockwise momentum (``momentum_dtype=torch.int8``): the quantizer against a reference of
8-bit Muon's (arXiv 2509.23106, linear scheme), its blocks whole on every shard, the step that rounds
the momentum once, and checkpoints that reshard it exactly.

The reference ``_paper_quantize`` is the paper's linear map on flat blocks of 2,048 elements of the
flattened tensor: ``[Q(x)]_i = (||x||_inf / 127) round(127 x_i / ||x||_inf)``. Ours keeps blocks of
``BLOCK`` columns of a row, so the two agree bit for bit wherever the blocks coincide (rows of 2,048
columns with ``block=2048``) and share the error bound elsewhere.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon
from muon_dtensor.numerics.blockwise import BLOCK, dequantize, quantize
from muon_dtensor.optim.state import MOMENTUM, MOMENTUM_ABSMAX
from tests.harness.ranks import run_ranks
from tests.helpers.models import distribute_like
from tests.helpers.named_params import AsModule, saved_and_final, snapshot, train
from tests.helpers.stage_layouts import gradient

SHAPES = {"a": (10, 512), "b": (6, 512), "c": (7, 300), "norm": (512,)}
SPLIT, TOTAL = 2, 4


def _paper_quantize(x: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """The paper's linear blockwise quantization, dequantized: flat blocks of ``block`` elements."""
    flat = x.reshape(-1, block)
    norm = flat.abs().amax(dim=1, keepdim=True)
    return ((norm / 127) * torch.round(127 * flat / norm)).reshape(x.shape)


def test_rows_of_one_block_quantize_as_the_papers_reference_bit_for_bit() -> None:
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(0))
    q, absmax = quantize(x, block=2048)
    assert q.dtype == torch.int8 and absmax.shape == (8, 1)
    assert torch.equal(dequantize(q, absmax, torch.float32, block=2048), _paper_quantize(x))


def test_the_error_is_at_most_half_a_level_of_each_block() -> None:
    x = torch.randn(16, 700, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 700)
    q, absmax = quantize(x)
    error = (dequantize(q, absmax, torch.float32) - x).abs()
    level = (absmax / 127).repeat_interleave(BLOCK, dim=-1)[:, :700]
    # half a level, plus the float32 roundings of 127 x / absmax and of the product (a few ulps)
    assert bool((error <= level * (0.5 + 1e-5)).all())
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(dim=-1) == 127).all())


def test_a_shard_on_block_boundaries_quantizes_as_the_full_tensor() -> None:
    x = torch.randn(9, 3 * BLOCK + 40, generator=torch.Generator().manual_seed(2))
    whole = quantize(x)
    pieces = [
        quantize(x[r, c]) for r in (slice(0, 4), slice(4, 9)) for c in (slice(0, BLOCK), slice(BLOCK, None))
    ]
    rows = [torch.cat([pieces[0][k], pieces[1][k]], 1) for k in (0, 1)]
    rows2 = [torch.cat([pieces[2][k], pieces[3][k]], 1) for k in (0, 1)]
    assert all(torch.equal(torch.cat([a, b]), w) for a, b, w in zip(rows, rows2, whole))


def test_zero_blocks_stay_zero() -> None:
    q, absmax = quantize(torch.zeros(3, 300))
    assert not q.any() and not absmax.any()
    assert not dequantize(q, absmax, torch.float32).any()


def test_huge_values_quantize_without_overflow_as_their_scaled_down_copy() -> None:
    """127 * x overflows float32 above 2.7e36: before, blocks near 1e37 quantized to garbage."""
    x = torch.randn(4, 2 * BLOCK + 10, generator=torch.Generator().manual_seed(5))
    big = x * 2.0**123  # about 1e37, the largest elements 4e37; a power of two: the same levels
    q, absmax = quantize(big)
    q_small, absmax_small = quantize(x)
    assert absmax.isfinite().all() and torch.equal(absmax, absmax_small * 2.0**123)
    assert torch.equal(q, q_small)
    back = dequantize(q, absmax, torch.float32)
    assert torch.equal(back, dequantize(q_small, absmax_small, torch.float32) * 2.0**123)


def test_levels_are_the_plain_formulas_bits_at_every_scale() -> None:
    """The scaling that avoids the overflow is exact: the bits of round(x * 127 / max) wherever that
    product is finite, for blocks far below and far above 1."""
    x = torch.randn(6, BLOCK, generator=torch.Generator().manual_seed(6))
    x = x * torch.tensor([1e-30, 1e-3, 0.7, 1.0, 3e5, 1e30])[:, None]
    q, _ = quantize(x)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.equal(q, torch.round(x * 127.0 / absmax).to(torch.int8))


def _one_process(dtype: torch.dtype | None, steps: int = 3) -> tuple[nn.Parameter, Muon]:
    w = nn.Parameter(torch.randn(64, 300, generator=torch.Generator().manual_seed(3)))
    opt = Muon([w], lr=0.02, momentum_dtype=dtype)
    for step in range(steps):
        w.grad = gradient("w", (64, 300), step)
        opt.step()
    return w, opt


@pytest.mark.parametrize("fault", ["shape", "negative", "nan", "missing", "int"])
def test_bad_block_maxima_in_a_state_dict_are_refused_at_load_naming_the_parameter(fault: str) -> None:
    """Before, these loaded (or failed inside the next step, on its data path)."""
    w, opt = _one_process(torch.int8, steps=1)
    sd = opt.state_dict()
    entry = sd["state"][0]
    if fault == "shape":
        entry[MOMENTUM_ABSMAX] = entry[MOMENTUM_ABSMAX][:, :1].clone()
    elif fault == "negative":
        entry[MOMENTUM_ABSMAX] = -entry[MOMENTUM_ABSMAX]
    elif fault == "nan":
        entry[MOMENTUM_ABSMAX] = entry[MOMENTUM_ABSMAX].clone().fill_(float("nan"))
    elif fault == "int":
        entry[MOMENTUM_ABSMAX] = entry[MOMENTUM_ABSMAX].to(torch.int32)
    else:
        del entry[MOMENTUM_ABSMAX]
    target = Muon([("w", w)], lr=0.02, momentum_dtype=torch.int8)
    before = {k: v.clone() for k, v in target.state[w].items()}
    with pytest.raises(ValueError, match=r"int8 momentum of 'w': its momentum_absmax .*nothing was loaded"):
        target.load_state_dict(sd)
    assert all(torch.equal(target.state[w][k], v) for k, v in before.items())
    assert target.param_groups[0]["lr"] == 0.02


def test_the_first_step_is_the_fp32_step_and_the_state_is_its_momentum_rounded_once() -> None:
    w8, opt8 = _one_process(torch.int8, steps=1)
    w32, opt32 = _one_process(None, steps=1)
    assert torch.equal(w8, w32)
    q, absmax = quantize(opt32.state[w32][MOMENTUM])
    assert torch.equal(opt8.state[w8][MOMENTUM], q) and torch.equal(opt8.state[w8][MOMENTUM_ABSMAX], absmax)


def test_state_dict_round_trips_and_converts_to_and_from_float_momentum() -> None:
    w, opt = _one_process(torch.int8)
    state = opt.state[w]
    again = Muon([w], lr=0.02, momentum_dtype=torch.int8)
    again.load_state_dict(opt.state_dict())
    assert all(torch.equal(again.state[w][k], state[k]) for k in (MOMENTUM, MOMENTUM_ABSMAX))
    wide = Muon([w], lr=0.02)
    with pytest.warns(UserWarning, match="int8 -> float32"):
        wide.load_state_dict(opt.state_dict())
    assert set(wide.state[w]) == {MOMENTUM}
    assert torch.equal(
        wide.state[w][MOMENTUM], dequantize(state[MOMENTUM], state[MOMENTUM_ABSMAX], torch.float32)
    )
    wide.param_groups[0]["momentum_dtype"] = "int8"  # a change between steps converts at the next
    w.grad = gradient("w", (64, 300), 9)
    with pytest.warns(UserWarning, match="float32 -> int8"):
        wide.step()
    assert wide.state[w][MOMENTUM].dtype == torch.int8 and MOMENTUM_ABSMAX in wide.state[w]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) / 4 for k, s in SHAPES.items()}


def build(layout: str | None, seed: int) -> tuple[dict[str, nn.Parameter], Muon]:
    """``layout`` None: one process. "fsdp x tp": a 2 x 2 mesh, "b" also on columns (256 each);
    "fsdp": every matrix on rows over 4 ranks; "hsdp": 2 replicas of 2 row shards."""
    fulls = _weights(seed)
    if layout is None:
        params = {k: nn.Parameter(v) for k, v in fulls.items()}
    else:
        shape = (4,) if layout == "fsdp" else (2, 2)
        mesh = init_device_mesh("cpu", shape)
        rows = (
            [Shard(0)]
            if layout == "fsdp"
            else [Replicate(), Shard(0)]
            if layout == "hsdp"
            else [Shard(0), Shard(0)]
        )
        cols = [Shard(0), Shard(1)] if layout == "fsdp x tp" else rows
        params = {
            k: nn.Parameter(distribute_tensor(v, mesh, cols if k == "b" else rows)) for k, v in fulls.items()
        }
    return params, Muon(_groups(params), lr=0.02, momentum_dtype=torch.int8)


def _groups(params: dict[str, nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [(n, p) for n, p in params.items() if n != "norm"]},
        {"params": [("norm", params["norm"])], "algorithm": "adamw"},
    ]


@functools.cache
def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return saved_and_final(*build(None, 0), SPLIT, TOTAL)


def sharded_runs(root: str) -> dict[str, Any]:
    params, opt = build("fsdp x tp", 0)
    train(params, opt, range(SPLIT))
    ckpt.save_checkpoint(root, SPLIT, AsModule(params), opt)
    out: dict[str, Any] = {"fsdp x tp": snapshot(params, opt)}
    train(params, opt, range(SPLIT, TOTAL))
    out["fsdp x tp after"] = snapshot(params, opt)
    for layout in ("fsdp", "hsdp"):
        params, opt = build(layout, seed=5)
        assert ckpt.load_checkpoint(root, AsModule(params), opt) == {"step": SPLIT}
        out[layout] = snapshot(params, opt)
        train(params, opt, range(SPLIT, TOTAL))
        out[f"{layout} after"] = snapshot(params, opt)
    return out


def test_sharded_steps_equal_one_process_and_a_checkpoint_reshards_exactly(tmp_path: Path) -> None:
    saved, final = reference()
    assert saved["a:momentum_buffer"].dtype == torch.int8 and "a:momentum_absmax" in saved
    for rank, r in enumerate(run_ranks(sharded_runs, 4, str(tmp_path), timeout=120)):
        for case, want in (("", saved), (" after", final)):
            for layout in ("fsdp x tp", "fsdp", "hsdp"):
                got = r[layout + case]
                assert [k for k in want if not torch.equal(got[k], want[k])] == [], (rank, layout + case)
    # 4 ranks -> one process: the same checkpoint into plain tensors
    params, opt = build(None, seed=7)
    assert ckpt.load_checkpoint(str(tmp_path), AsModule(params), opt) == {"step": SPLIT}
    assert [k for k, v in snapshot(params, opt).items() if not torch.equal(v, saved[k])] == []


def _refusals(root: str) -> list[str]:
    mesh = init_device_mesh("cpu", (2,))
    errors = []
    p = nn.Parameter(distribute_tensor(torch.randn(4, 300), mesh, [Shard(1)]))  # 150 columns each
    try:
        Muon([("w", p)], lr=0.02, momentum_dtype=torch.int8)
    except ValueError as e:
        errors.append(str(e))
    for value in ("int8", torch.int8):  # switched to int8 after construction: refused at the next step
        opt = Muon([("w", p)], lr=0.02)  # (the dtype, before, quantized each shard's 150 columns)
        opt.param_groups[0]["momentum_dtype"] = value
        p.grad = distribute_like(p, torch.ones(4, 300))
        try:
            opt.step()
        except ValueError as e:
            errors.append(str(e))
    params, opt8 = build(None, 0)  # a float32-momentum checkpoint into an int8 optimizer
    ckpt.save_checkpoint(root, 1, AsModule(params), Muon(_groups(params), lr=0.02))
    try:
        ckpt.load_checkpoint(root, AsModule(params), opt8)
    except ckpt.CheckpointError as e:
        errors.append(str(e))
    q = nn.Parameter(distribute_tensor(torch.randn(8, 260), mesh, [Shard(1)]))  # 130 columns each
    try:  # every refused matrix in one error, the fine one not
        Muon(
            [("w", p), ("fine", nn.Parameter(torch.randn(4, 4))), ("u", q)],
            lr=0.02,
            momentum_dtype=torch.int8,
        )
    except ValueError as e:
        errors.append(str(e))
    dist.barrier()
    return errors


def test_a_shard_that_cuts_a_block_and_a_float_checkpoint_are_refused_on_every_rank(tmp_path: Path) -> None:
    for errors in run_ranks(_refusals, 2, str(tmp_path), timeout=60):
        assert len(errors) == 5, errors
        assert errors[0] == errors[1] == errors[2] and "parameter 'w'" in errors[0], errors
        assert errors[4].startswith("2 parameters cannot keep momentum_dtype=torch.int8"), errors[4]
        assert "parameter 'w'" in errors[4] and "parameter 'u'" in errors[4] and "'fine'" not in errors[4]
        assert "columns [0, 150) of 300" in errors[0] and "multiple of 256 columns" in errors[0], errors[0]
        assert "'a' float32 -> int8" in errors[3] and "Nothing was loaded" in errors[3], errors[3]


def _momentum_ops(count: int) -> int:
    """Top-level aten ops of the 8-bit momentum pass over ``count`` matrices of each of 3 shapes."""
    from torch.profiler import ProfilerActivity, profile

    from muon_dtensor.base.op_count import top_level_ops
    from muon_dtensor.numerics.blockwise import absmax_shape, int8_nesterov_inputs

    shapes = [(8, 300), (16, 256), (4, 40)] * count
    qs = [torch.zeros(s, dtype=torch.int8) for s in shapes]
    absmaxes = [torch.zeros(absmax_shape(s)) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        int8_nesterov_inputs(qs, absmaxes, grads, 0.95, True, torch.bfloat16)
    return len(top_level_ops(prof))


def test_the_host_issues_ops_per_shape_not_per_parameter() -> None:
    """Stacked per shape: 4 times the parameters of the same 3 shapes add only the stacks' and
    copies' list arguments, not ops (the allocation of the inputs grows with shapes as well)."""
    _momentum_ops(2)  # a process's first pass asks torch once for a dtype (aten::promote_types)
    assert _momentum_ops(8) == _momentum_ops(2)


def test_plan_counts_int8_momentum_as_muon_memory_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --momentum-dtype``: one process, the bytes ``Muon.memory`` reports for the same
    matrices; over 4 row shards, every rank's values and maxima add up to the whole's."""
    from muon_dtensor.planning.plans import rank_memory
    from muon_dtensor.tools.plan_command import main as plan_main

    shapes = ((64, 300), (96, 512), (40, 40))
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = Muon(params, lr=0.02, momentum_dtype=torch.int8)
    whole = sum(r * c + 4 * r * -(-c // BLOCK) for r, c in shapes)
    assert opt.memory()["momentum"] == rank_memory(shapes, 1, 1, False, None, "int8")[0][0] == whole
    assert sum(rank_memory(shapes, 4, 1, False, None, "int8")[0]) == whole
    bf16 = rank_memory(shapes, 4, 1, False, None, "bfloat16")[0]
    assert [2 * b for b in bf16] == list(rank_memory(shapes, 4, 1, False, None, "float32")[0])
    assert plan_main(["--model", "llama3-8b", "--gpus", "64", "--momentum-dtype", "int8"]) == 0
    assert "int8 momentum 105.6 MiB - 105.6 MiB" in capsys.readouterr().out
