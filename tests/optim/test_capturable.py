"""``Muon(capturable=True)``: a steady step a CUDA graph can replay with the learning rate changing.

With a 0-dim tensor lr on the parameters' device, changed in place as a schedule does (``fill_``),
the Muon step keeps lr, its ``1 - lr wd`` and ``lr * factor`` on the device in float64 (the Python
float's arithmetic), and AdamW groups run torch's own capturable AdamW (counters and bias correction
on the device). CPU has no graphs and torch refuses capturable AdamW there, so these tests let the
CPU stand in for CUDA (``cpu_stands_in``) and check what a graph needs: nothing read back, the same
ops and allocations every step, and the bits of the float-lr step (Muon) and of
``torch.optim.AdamW(capturable=True)`` (AdamW), in one process and sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.optim.adam as torch_adam
import torch.optim.optimizer as torch_optimizer
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.sharding.plan.param_layout import local_of
from tests.harness.ranks import run_ranks
from tests.helpers.models import build, distribute_like, full, model_grads
from tests.optim.test_capture_safety import Allocations
from tests.optim.test_host_sync import SyncWatch

STEPS = 4


@contextlib.contextmanager
def cpu_stands_in() -> Iterator[None]:
    """torch's capturable devices with the CPU added, for our check and torch's capturable AdamW."""
    devices = [*torch_optimizer._get_capturable_supported_devices(), "cpu"]
    with (
        mock.patch.object(torch_optimizer, "_get_capturable_supported_devices", lambda *a, **k: devices),
        mock.patch.object(torch_adam, "_get_capturable_supported_devices", lambda *a, **k: devices),
    ):
        yield


def lr_at(step: int) -> float:
    return 0.02 * (1.0 - 0.1 * step)


def run(world: int, capturable: bool, watch_step: int | None = None) -> dict[str, Any]:
    """``STEPS`` steps of tests.helpers.models' Net (one process, or FSDP2 over ``world`` ranks) with the
    lr changed before each: a float64 tensor filled in place (``capturable``), else floats. Returns
    the full weights and state, and for ``watch_step`` its ops and host reads."""
    model = build((world,) if world > 1 else None)
    lr = torch.tensor(lr_at(0), dtype=torch.float64)
    groups = split_params(model)
    opt = Muon(groups, lr=lr if capturable else lr_at(0), capturable=capturable)
    grads = model_grads(model, 30)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        for p, g in zip(model.parameters(), grads(step)):
            p.grad = distribute_like(p, g)
        if capturable:
            lr.fill_(lr_at(step))
        else:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        if step != watch_step:
            opt.step()
            continue
        ops, watch = Allocations(), SyncWatch([lr, *_device_tensors(model, opt)])
        with ops, watch:
            opt.step()
        out["ops"], out["found"] = ops.ops, watch.found
    out["state"] = {
        f"{n}:{k}": full(v).clone()
        for n, p in model.named_parameters()
        for k, v in [("w", p.detach()), *opt.state[p].items()]
    }
    out["muon"] = [n for g in opt.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]
    return out


def _device_tensors(model: nn.Module, opt: Muon) -> list[torch.Tensor]:
    params = list(model.parameters())
    return [local_of(t) for p in params for t in (p, p.grad, *opt.state[p].values()) if t is not None]


def torch_adamw(world: int) -> dict[str, torch.Tensor]:
    """The AdamW parameters of the same run under ``torch.optim.AdamW(capturable=True)``."""
    model = build(None)
    adamw = [g for g in split_params(model) if g.get("algorithm") == "adamw"]
    lr = torch.tensor(lr_at(0), dtype=torch.float64)
    opt = torch.optim.AdamW(
        [{"params": [p for _, p in g["params"]], **{k: v for k, v in g.items() if k in ("weight_decay", "betas", "eps")}} for g in adamw],
        lr=lr, capturable=True, foreach=True,
    )  # fmt: skip
    grads = model_grads(model, 30)
    for step in range(STEPS):
        for p, g in zip(model.parameters(), grads(step)):
            p.grad = g
        lr.fill_(lr_at(step))
        opt.step()
    return {f"{n}:w": p.detach().clone() for g in adamw for n, p in g["params"]}


def steady(world: int) -> dict[str, Any]:
    with cpu_stands_in():
        plain, captured = run(world, False), run(world, True, watch_step=STEPS - 1)
        before = run(world, True, watch_step=STEPS - 2)
    return {"plain": plain, "captured": captured, "before": before}


def _check(r: dict[str, Any], reference: dict[str, Any] | None = None) -> None:
    plain, captured = r["plain"]["state"], r["captured"]["state"]
    muon = [k for k in plain if k.split(":")[0] in r["plain"]["muon"]]
    assert muon and [k for k in muon if not torch.equal(plain[k], captured[k])] == []
    assert r["captured"]["found"] == [], r["captured"]["found"]
    assert r["before"]["ops"] == r["captured"]["ops"]  # the same ops and allocations, step to step
    if reference is not None:
        assert [k for k in reference if not torch.equal(captured[k], reference[k])] == []


def test_one_process_steps_as_the_float_lr_and_torchs_capturable_adamw() -> None:
    r = steady(1)
    with cpu_stands_in():
        adamw = torch_adamw(1)
    assert adamw
    _check(r, adamw)


def test_sharded_steps_equal_the_one_process_capturable_step() -> None:
    one = steady(1)["captured"]["state"]
    for rank, r in enumerate(run_ranks(steady, 2, 2, timeout=120)):
        _check(r)
        assert [k for k in one if not torch.equal(r["captured"]["state"][k], one[k])] == [], rank


def test_a_float_lr_the_group_reads_is_a_host_read_the_capturable_step_avoids() -> None:
    """Without capturable a tensor lr is read every step as a float: host reads (a sync each on
    CUDA); checked (``lr >= 0``, a ``__bool__``) only at a step where its value changed, as each
    group's settings are kept until then (``checks/settings_cache.py``). With it, neither."""
    model = build(None)
    lr = torch.tensor(0.02, dtype=torch.float64)
    for capturable, expected in ((False, {"__float__"}), (True, set())):
        with cpu_stands_in():
            opt = Muon(split_params(model), lr=lr, capturable=capturable)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            watch = SyncWatch([lr])
            with watch:
                opt.step()
        assert set(watch.found) == expected, watch.found
        if not capturable:  # a new value: checked again (lr >= 0) before it is read
            with cpu_stands_in():
                lr.fill_(0.03)
                watch = SyncWatch([lr])
                with watch:
                    opt.step()
            assert set(watch.found) == {"__bool__", "__float__"}, watch.found


def test_refused_where_torch_cannot_capture_naming_the_parameter() -> None:
    """At the first step, whose local checks fail on every rank together: at construction a rank
    that alone passed capturable=True raised alone while its peers waited in their first step."""
    model = build(None)
    opt = Muon(split_params(model), lr=0.02, capturable=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=r"parameter '.*' is on cpu, but capturable=True is for parameters on a device"
    ):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt = Muon(split_params(model), lr=0.02)  # switched on later: the same check
    opt.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match=r"is on cpu, but capturable=True"):
        opt.step()
    with cpu_stands_in(), pytest.raises(ValueError, match="capturable should be True or False"):
        Muon(split_params(model), lr=0.02, capturable="yes")  # type: ignore[arg-type]


def test_a_load_keeps_this_optimizers_capturable() -> None:
    """``capturable`` says how this job keeps its scalars (on a GPU or not), not what the run was:
    a state dict saved with it loads into an optimizer without it, and back, each keeping its own."""
    model = build(None)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with cpu_stands_in():
        captured = Muon(split_params(model), lr=0.02, capturable=True)
        captured.step()
        plain = Muon(split_params(model), lr=0.02)
        plain.load_state_dict(captured.state_dict())
        captured.load_state_dict(plain.state_dict())
    assert {g["capturable"] for g in plain.param_groups} == {False}
    assert {g["capturable"] for g in captured.param_groups} == {True}
    plain.step()  # AdamW's counters came back to the host: the float path steps
    counters = {s["step"].device.type for s in plain.state.values() if "step" in s}
    assert counters == {"cpu"}


def _stepped_pair(lr: torch.Tensor) -> tuple[nn.Module, Muon]:
    model = build(None)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = Muon(split_params(model), lr=lr, capturable=True)
    opt.step()
    return model, opt


def _moved(model: nn.Module, opt: Muon) -> float:
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    return max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("via", ["load_state_dict", "load_checkpoint"])
def test_a_load_copies_the_lr_into_the_groups_own_tensor(via: str, tmp_path: Any) -> None:
    """docs/design.md's recipe (``lr.fill_``) keeps driving the step after a load: before, the load
    left a new tensor in the group and ``fill_(0.0)`` still moved the weights by 0.0138. A capturable
    run's tensor lr loads into a float-lr optimizer as a float, and a float lr into the tensor."""
    import muon_dtensor.checkpoint as ckpt

    with cpu_stands_in():
        saved_model, saved = _stepped_pair(torch.tensor(0.03, dtype=torch.float64))
        floats = Muon(split_params(saved_model), lr=0.01)
        if via == "load_checkpoint":
            ckpt.save_checkpoint(tmp_path, 1, saved_model, saved)
        lr = torch.tensor(0.02, dtype=torch.float64)
        model, opt = _stepped_pair(lr)
        for target, into in ((opt, model), (floats, saved_model)):
            if via == "load_state_dict":
                target.load_state_dict(saved.state_dict())
            else:
                ckpt.load_checkpoint(tmp_path, into, target, step=1)
        assert all(g["lr"] is lr for g in opt.param_groups) and float(lr) == 0.03
        assert {type(g["lr"]) for g in floats.param_groups} == {float}
        assert {g["lr"] for g in floats.param_groups} == {0.03}
        lr.fill_(0.5)  # a float-lr state dict into the tensor: copied in too
        if via == "load_state_dict":
            opt.load_state_dict(floats.state_dict())
        else:
            ckpt.save_checkpoint(tmp_path, 2, saved_model, floats)
            ckpt.load_checkpoint(tmp_path, model, opt, step=2)
        assert all(g["lr"] is lr for g in opt.param_groups) and float(lr) == 0.03
        lr.fill_(0.0)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        assert _moved(model, opt) == 0.0
        lr.fill_(0.02)
        assert _moved(model, opt) > 0.0
