"""``momentum_dtype`` on one process: the checks, the state's dtype, the arithmetic (a buffer of
another dtype updated in the wider one, stored rounded once, Newton-Schulz fed the unrounded value),
``load_state_dict`` keeping and converting dtypes, and a change between steps."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from muon_dtensor import Muon, split_params
from muon_dtensor.numerics.newton_schulz import NSConfig, orthogonalize

SHAPES = [(37, 24), (24, 37), (16, 16)]
M = 0.95


def _params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]


def _step(opt: Muon, params: Sequence[nn.Parameter], step: int) -> None:
    for p, g in zip(params, _grads(step, params[0].dtype)):
        p.grad = g
    opt.step()


def _bufs(opt: Muon, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"] for p in params]


@pytest.mark.parametrize("value", [torch.int16, torch.uint8, torch.complex64])
def test_bad_values_are_refused_naming_value_and_fix(value: Any) -> None:
    with pytest.raises(ValueError, match=r"momentum_dtype should be None .* but is: .*; pass one of them"):
        Muon(_params(), momentum_dtype=value)
    with pytest.raises(ValueError, match=r"momentum_dtype should be None"):
        Muon([{"params": _params(), "momentum_dtype": value}])


@pytest.mark.parametrize("value", ["bf16", "torch.bfloat16", "float8", 3, True, 2.0])
def test_values_that_name_no_momentum_dtype_are_refused_everywhere(value: Any) -> None:
    """One rule wherever ``momentum_dtype`` is given: a dtype or its name. Anything else is refused
    naming the value: in the constructor, in a group's dict, and set on a group later (at the next
    step, before anything changes)."""
    pattern = r"momentum_dtype should be None .* \(or its name, e.g. 'bfloat16'\) but is: "
    with pytest.raises(ValueError, match=pattern):
        Muon(_params(), momentum_dtype=value)
    with pytest.raises(ValueError, match=pattern):
        Muon([{"params": _params(), "momentum_dtype": value}])
    params = _params()
    opt = Muon(params, lr=0.02)
    _step(opt, params, 0)
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["momentum_dtype"] = value
    with pytest.raises(ValueError, match=pattern):
        _step(opt, params, 1)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


@pytest.mark.filterwarnings("ignore:momentum buffers found")
@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bfloat16"), (torch.int8, "int8")])
def test_a_dtype_and_its_name_are_one_value_everywhere(dtype: torch.dtype, name: str) -> None:
    """Regression (issue 49.7): a group's ``"momentum_dtype": "bfloat16"`` set later was accepted
    while the constructor refused the name, and docs/api.md said names were refused. Now the
    constructor, a group's dict and a group set later take the dtype and its name alike (the group
    stores the name, as ``ns_dtype`` does), and the four step bit for bit alike."""
    runs = []
    for how in ("constructor_dtype", "constructor_name", "group_name", "set_later_name"):
        params = _params()
        value = dtype if how == "constructor_dtype" else name
        if how.startswith("constructor"):
            opt = Muon(params, lr=0.02, momentum_dtype=value)
        elif how == "group_name":
            opt = Muon([{"params": params, "momentum_dtype": value}], lr=0.02)
        else:
            opt = Muon(params, lr=0.02)
            opt.param_groups[0]["momentum_dtype"] = value
        for step in range(3):
            _step(opt, params, step)
        assert opt.param_groups[0]["momentum_dtype"] == name
        runs.append([p.detach().clone() for p in params] + _bufs(opt, params))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


def test_float16_momentum_is_refused_with_the_reason_and_bfloat16() -> None:
    """fp16 momentum with gradients near 1e6 filled the buffer with inf and every parameter was NaN
    six steps later, silently: float16 is refused wherever it is set, also on a group later."""
    with pytest.raises(
        ValueError, match=r"float16 is refused: float16 overflows to inf above 65,504.*torch.bfloat16"
    ):
        Muon(_params(), momentum_dtype=torch.float16)
    opt = Muon(_params(), lr=0.02)
    opt.param_groups[0]["momentum_dtype"] = torch.float16
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.full_like(p, 1e6)
    with pytest.raises(ValueError, match=r"float16 is refused"):
        opt.step()


def test_a_load_that_would_overflow_the_narrower_dtype_is_refused_before_anything_changes() -> None:
    """A float64 buffer beyond bfloat16's range: converting it at load would make inf values."""
    names = ["w0", "w1", "w2"]
    source = Muon(list(zip(names, _params(dtype=torch.float64))), lr=0.02)
    source.state[source.param_groups[0]["params"][1]]["momentum_buffer"].fill_(1e300)
    saved = source.state_dict()
    target = Muon(list(zip(names, _params(dtype=torch.float64))), lr=0.02, momentum_dtype=torch.bfloat16)
    before = [b.clone() for b in _bufs(target, target.param_groups[0]["params"])]
    with pytest.raises(
        ValueError,
        match=r"momentum buffer of 'w1': converting it from float64 to .* bfloat16 would turn \d+ finite value",
    ):
        target.load_state_dict(saved)
    after = _bufs(target, target.param_groups[0]["params"])
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "nothing was loaded"


def test_an_adamw_group_of_its_own_is_refused_an_inherited_default_is_not() -> None:
    params = _params()
    with pytest.raises(ValueError, match=r"param group 1 is an AdamW group and sets 'momentum_dtype'"):
        groups: list[dict[str, Any]] = [
            {"params": params[:2]},
            {"params": params[2:], "algorithm": "adamw", "momentum_dtype": "bfloat16"},
        ]
        Muon(groups)
    bias = nn.Parameter(torch.zeros(5))
    both: list[dict[str, Any]] = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = Muon(both, momentum_dtype=torch.bfloat16)
    assert opt.state[bias]["exp_avg"].dtype == torch.float32  # AdamW keeps the parameter's dtype
    assert all(b.dtype == torch.bfloat16 for b in _bufs(opt, params))


@pytest.mark.parametrize("value", [torch.bfloat16, "bfloat16", torch.float32])
def test_an_adamw_groups_momentum_dtype_set_later_is_refused_naming_the_group(value: Any) -> None:
    """Regression (issue 49.7): an AdamW group's ``momentum_dtype`` set after construction was
    ignored (its moments stayed in the parameter's dtype, silently). The group stores None, not the
    optimizer's default, and the next step refuses any other value, naming the group, before
    anything changes; set back to None, it steps."""
    params, bias = _params(), nn.Parameter(torch.zeros(5))
    groups: list[dict[str, Any]] = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = Muon(groups, momentum_dtype=torch.bfloat16)
    assert opt.param_groups[1]["momentum_dtype"] is None  # not the optimizer's "bfloat16"
    bias.grad = torch.ones(5)
    _step(opt, params, 0)
    before = [p.detach().clone() for p in [*params, bias]]
    opt.param_groups[1]["momentum_dtype"] = value
    with pytest.raises(ValueError, match=r"param group 1 is an AdamW group and sets 'momentum_dtype'"):
        _step(opt, params, 1)
    assert all(torch.equal(p, b) for p, b in zip([*params, bias], before))
    opt.param_groups[1]["momentum_dtype"] = None
    _step(opt, params, 1)
    assert not torch.equal(bias, before[-1])


@pytest.mark.parametrize(
    ("value", "name", "dtype"),
    [
        (None, None, torch.float32),
        (torch.bfloat16, "bfloat16", torch.bfloat16),
        (torch.float32, "float32", torch.float32),
        (torch.float64, "float64", torch.float64),
    ],
)
def test_state_is_created_in_the_dtype_and_the_group_stores_its_name(
    value: Any, name: str | None, dtype: torch.dtype
) -> None:
    params = _params()
    opt = Muon(params, momentum_dtype=value)
    assert opt.param_groups[0]["momentum_dtype"] == name
    assert [b.dtype for b in _bufs(opt, params)] == [dtype] * len(params)
    per_group = Muon([{"params": params, "momentum_dtype": value}])
    assert per_group.param_groups[0]["momentum_dtype"] == name
    assert opt.memory()["momentum"] == sum(p.numel() for p in params) * dtype.itemsize


def _recording(inputs: list[torch.Tensor]) -> Any:
    def run(matrices: Sequence[torch.Tensor], config: NSConfig) -> list[torch.Tensor]:
        inputs.extend(m.clone() for m in matrices)
        return orthogonalize(matrices, config)

    return run


def test_first_step_is_the_fp32_step_then_the_state_carries_one_rounding() -> None:
    """Step 1: parameters bitwise those of fp32 momentum, buffer the fp32 buffer rounded once.
    Step 2: the buffer and the Newton-Schulz input follow the documented ops exactly."""
    wide, narrow = _params(), _params()
    seen: list[torch.Tensor] = []
    ref = Muon(wide, lr=0.02, momentum=M)
    opt = Muon(narrow, lr=0.02, momentum=M, momentum_dtype=torch.bfloat16, orthogonalize_fn=_recording(seen))
    _step(ref, wide, 0)
    _step(opt, narrow, 0)
    assert all(torch.equal(p, q) for p, q in zip(wide, narrow))
    assert all(torch.equal(b.bfloat16(), c) for b, c in zip(_bufs(ref, wide), _bufs(opt, narrow)))
    before = [b.float() for b in _bufs(opt, narrow)]  # exact widening of the stored bf16 values
    seen.clear()
    _step(opt, narrow, 1)
    for b, g, stored, x in zip(before, _grads(1), _bufs(opt, narrow), _by_shape(seen)):
        scaled = g * (1.0 - M)
        unrounded = b * M + scaled  # two fp32 roundings: no fused multiply-add
        assert torch.equal(stored, unrounded.bfloat16())
        assert torch.equal(x, (unrounded * M + scaled).bfloat16())  # from the unrounded value
        assert not torch.equal(x, (stored.float() * M + scaled).bfloat16())  # the other choice differs


def _by_shape(seen: list[torch.Tensor]) -> list[torch.Tensor]:
    """The recorded Newton-Schulz inputs in parameter order (owners batch same shapes)."""
    return [next(x for x in seen if tuple(x.shape) == s) for s in SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_parameters_own_dtype_is_the_default_step_bitwise(dtype: torch.dtype) -> None:
    default, named = _params(dtype), _params(dtype)
    a, b = Muon(default, lr=0.02), Muon(named, lr=0.02, momentum_dtype=dtype)
    for step in range(3):
        _step(a, default, step)
        _step(b, named, step)
    assert all(torch.equal(p, q) for p, q in zip(default, named))
    assert all(torch.equal(x, y) for x, y in zip(_bufs(a, default), _bufs(b, named)))


def test_a_buffer_wider_than_its_parameter_survives_state_dict_bitwise() -> None:
    """torch's load casts state to the parameter's dtype; fp32 momentum of bf16 parameters must not
    round to bf16 on a resume, and the resumed run is the uninterrupted one, bitwise."""
    run, fresh, through = _params(torch.bfloat16), _params(torch.bfloat16), _params(torch.bfloat16)
    opt = Muon(run, lr=0.02, momentum_dtype=torch.float32)
    first = Muon(through, lr=0.02, momentum_dtype=torch.float32)
    for step in range(2):
        _step(opt, run, step)
        _step(first, through, step)
    saved = first.state_dict()
    for p, q in zip(through, fresh):
        q.data.copy_(p.data)
    resumed = Muon(fresh, lr=0.02, momentum_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same dtype: no conversion, no warning
        resumed.load_state_dict(saved)
    assert all(torch.equal(x, y) for x, y in zip(_bufs(resumed, fresh), _bufs(opt, run)))
    assert all(b.dtype == torch.float32 for b in _bufs(resumed, fresh))
    _step(opt, run, 2)
    _step(resumed, fresh, 2)
    assert all(torch.equal(p, q) for p, q in zip(run, fresh))


@pytest.mark.parametrize(("saved", "configured"), [(None, torch.bfloat16), (torch.bfloat16, None)])
def test_load_keeps_the_configured_dtype_and_converts_with_a_warning(
    saved: torch.dtype | None, configured: torch.dtype | None
) -> None:
    names = [f"w{i}" for i in range(len(SHAPES))]
    source = Muon(list(zip(names, _params())), lr=0.02, momentum_dtype=saved)
    _step(source, source.param_groups[0]["params"], 0)
    state = source.state_dict()
    target = Muon(list(zip(names, _params(seed=1))), lr=0.02, momentum_dtype=configured)
    saved_name = str(saved or torch.float32).removeprefix("torch.")
    new_name = str(configured or torch.float32).removeprefix("torch.")
    pattern = rf"'w0' {saved_name} -> {new_name}.*set momentum_dtype=torch\.{saved_name}"
    with pytest.warns(UserWarning, match=pattern):
        target.load_state_dict(state)
    assert target.param_groups[0]["momentum_dtype"] == (None if configured is None else new_name)
    for b, c in zip(
        _bufs(source, source.param_groups[0]["params"]), _bufs(target, target.param_groups[0]["params"])
    ):
        assert torch.equal(c, b.to(configured or torch.float32))  # one rounding, or exact widening


def test_a_change_between_steps_converts_at_the_next_step() -> None:
    params = _params()
    opt = Muon(params, lr=0.02)
    _step(opt, params, 0)
    before = [b.clone() for b in _bufs(opt, params)]
    opt.param_groups[0]["momentum_dtype"] = torch.bfloat16
    with pytest.warns(UserWarning, match=r"found in another dtype .* float32 -> bfloat16"):
        _step(opt, params, 1)
    # converted first (one rounding), then stepped as any bf16 buffer
    expected = [(b.bfloat16().float() * M + g * (1.0 - M)).bfloat16() for b, g in zip(before, _grads(1))]
    assert all(torch.equal(b, e) for b, e in zip(_bufs(opt, params), expected))
    assert opt.memory()["momentum"] == sum(p.numel() for p in params) * 2


def test_a_replaced_parameter_keeps_the_buffers_dtype() -> None:
    """A parameter swapped for another object (as accelerate does) hands its state over; the
    buffer keeps momentum_dtype, not the new parameter's dtype."""
    params = _params()
    opt = Muon(params, lr=0.02, momentum_dtype=torch.bfloat16)
    _step(opt, params, 0)
    kept = _bufs(opt, params)[0].clone()
    swapped = nn.Parameter(params[0].detach().clone())
    opt.param_groups[0]["params"][0] = swapped
    state = opt.state_dict()["state"][0]["momentum_buffer"]
    assert state.dtype == torch.bfloat16 and torch.equal(state, kept)


def test_the_conversion_warning_points_at_the_users_line() -> None:
    """It pointed at a line of the package (checkpoint/publish.py, optim/state.py): now at the call
    the user wrote, through torch's step hooks too."""
    params = _params()
    opt = Muon(params, lr=0.02)
    _step(opt, params, 0)
    opt.param_groups[0]["momentum_dtype"] = torch.bfloat16
    for p, g in zip(params, _grads(1)):
        p.grad = g
    with pytest.warns(UserWarning, match="found in another dtype") as seen:
        opt.step()
    assert [w.filename for w in seen] == [__file__]


def _warned_on_each_rank() -> int:
    import warnings

    from tests.helpers.models import build

    model = build((2,))
    opt = Muon(split_params(model), lr=0.02)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["momentum_dtype"] = torch.bfloat16  # on every rank alike
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    return sum("found in another dtype" in str(w.message) for w in seen)


def test_a_warning_every_rank_would_print_is_printed_once_per_job() -> None:
    from tests.harness.ranks import run_ranks

    assert run_ranks(_warned_on_each_rank, 2, timeout=60) == [1, 0]
