"""Changing optimizers mid-run, Hugging Face weights in, and checkpoints across module wrappers.

- Muon from a checkpoint without Muon state (saved with AdamW, weights only, other groups) is refused
  on every rank, naming ``optimizer_state="fresh"``; with it the weights load, the optimizer restarts
  (zero momentum, step 0, one log line) and the next sharded step is bitwise the one-process step.
- ``model.safetensors`` (``save_file``, ``save_pretrained``) into FSDP2 / TP models on 2 and 4 ranks,
  bitwise as into the whole model, each rank reading only its rows; bad names fail naming the FQN.
- ``torch.compile`` and activation checkpointing change no checkpoint, in both directions. The 2-rank
  test wraps with ``torch.compile`` but steps with synthetic gradients (no compiled code runs); the
  one-process test runs compiled code with ``backend="eager"`` (inductor takes over a minute on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import FileSystemReader

import muon_dtensor.checkpoint.loading as loading
import muon_dtensor.checkpoint.safetensors as st
from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import CheckpointError, load_checkpoint, load_safetensors, save_checkpoint
from tests.harness.ranks import run_ranks
from tests.helpers.models import MLP, Net, fsdp, full, model_grads, shard_mlp, step_together

TIMEOUT = 120.0  # seconds per multi-rank call
WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")
LOGGER = "muon_dtensor.checkpoint.loading"


def _net(seed: int, ranks: int | None = None, wrapped: bool = False) -> nn.Module:
    """A Net from ``seed``; ``wrapped``: activation checkpointing per layer and torch.compile around
    the root; sharded (FSDP2) over ``ranks`` ranks, or whole (None)."""
    torch.manual_seed(seed)
    model: nn.Module = Net()
    if wrapped:
        layers: Any = model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
        model.lm_head = checkpoint_wrapper(
            cast(nn.Module, model.lm_head)
        )  # split_params must still see a head
    if ranks is not None:
        model = fsdp(model, (ranks,))
    if wrapped:
        model = torch.compile(model, backend="eager")  # type: ignore[assignment]
    return model


def _with_muon(model: nn.Module, adamw: tuple[str, ...] = ()) -> tuple[nn.Module, Muon]:
    return model, Muon(split_params(model, adamw=adamw), lr=0.02)


def _plain(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {_plain(n): full(p.detach()).clone() for n, p in model.named_parameters()}


def _states(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{_plain(n)}:{k}": full(v).clone()
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
    }


def _step(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    step_together([(list(model.parameters()), opt)], model_grads(model, 500), steps)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _error(work: Any) -> tuple[str, str]:
    try:
        work()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return type(e).__name__, str(e)
    return "none", ""


@pytest.mark.parametrize("source", ["adamw", "weights_only"])
def test_muon_from_an_adamw_or_weights_only_checkpoint_on_two_ranks(source: str, tmp_path: Path) -> None:
    root = str(tmp_path)
    results = run_ranks(switch_to_muon, 2, root, source, timeout=TIMEOUT)
    reference, opt = _with_muon(_net(3))  # one process: the saved weights, a new Muon, the same step
    load_checkpoint(root, reference)
    saved = _weights(reference)
    _step(reference, opt, range(7, 8))
    for rank, r in enumerate(results):
        kind, message = r["refused"]
        assert kind == "CheckpointError" and r["untouched"], (rank, kind, message)
        # the fix first, then a few of the missing keys (the AdamW checkpoint has no Muon state)
        assert "optimizer_state='fresh'" in message, message
        assert message.index("optimizer_state='fresh'") < message.index(
            "Missing from the checkpoint: optimizer.state."
        )
        assert " more." in message, message
        assert r["info"] == {"step": 2}
        assert _equal(r["loaded"], saved), f"rank {rank}: weights differ from the checkpoint's"
        assert r["zero_state"] and r["state_keys"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
        assert r["logged"] == (1 if rank == 0 else 0), r["logged"]
        assert _equal(r["stepped"], _weights(reference)), f"rank {rank}: step differs from one process"


def test_muon_with_other_groups_needs_fresh_too(tmp_path: Path) -> None:
    """A Muon checkpoint with no Muon group (all on AdamW) is refused with the way out, and loads
    fresh. Muon state keyed per FQN in 3 groups loads into 2, or 3 split elsewhere, as saved."""
    model = _net(0)
    muon, adamw = split_params(model)
    everything = [{"params": list(model.named_parameters()), "algorithm": "adamw"}]
    save_checkpoint(tmp_path / "a", 1, model, Muon(everything))
    target = _net(1)
    opt = Muon(split_params(target), lr=0.02)
    pattern = r"Missing from the checkpoint: optimizer\.state\.layers\.0\.weight\.momentum_buffer"
    with pytest.raises(CheckpointError, match=pattern) as refused:
        load_checkpoint(tmp_path / "a", target, opt)
    assert "optimizer_state='fresh'" in str(refused.value), refused.value
    assert load_checkpoint(tmp_path / "a", target, opt, optimizer_state="fresh") == {"step": 1}
    assert _equal(_weights(target), _weights(model))
    three = Muon([{"params": muon["params"][:2]}, {"params": muon["params"][2:]}, adamw])
    save_checkpoint(tmp_path / "b", 1, model, three)
    for groups in (
        lambda m, a: [m, a],
        lambda m, a: [{"params": m["params"][:3]}, {"params": m["params"][3:]}, a],
    ):
        target = _net(1)
        opt = Muon(groups(*split_params(target)), lr=0.02)
        assert load_checkpoint(tmp_path / "b", target, opt) == {"step": 1}
        assert _equal(_states(target, opt), _states(model, three)) and _equal(
            _weights(target), _weights(model)
        )


def test_fresh_restarts_a_trained_optimizer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Fresh means fresh even when the checkpoint holds this optimizer's state and the optimizer has
    stepped: the next step is a new optimizer's first step, and hyperparameters stay as they are."""
    model, opt = _with_muon(_net(0))
    _step(model, opt, range(2))
    save_checkpoint(tmp_path, 2, model, opt)
    _step(model, opt, range(2, 4))  # momentum and AdamW steps move on
    opt.param_groups[0]["lr"] = 0.01
    groups = list(opt.param_groups)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        load_checkpoint(tmp_path, model, opt, optimizer_state="fresh")
    assert [r.getMessage() for r in caplog.records if "optimizer starts fresh" in r.getMessage()]
    assert opt.param_groups[0]["lr"] == 0.01 and all(a is b for a, b in zip(groups, opt.param_groups))
    twin, twin_opt = _with_muon(_net(9))
    load_checkpoint(tmp_path, twin)
    twin_opt.param_groups[0]["lr"] = 0.01
    _step(model, opt, range(4, 5))
    _step(twin, twin_opt, range(4, 5))
    assert _equal(_weights(model), _weights(twin)) and _equal(_states(model, opt), _states(twin, twin_opt))


def test_optimizer_state_argument_is_checked_before_any_file_is_read(tmp_path: Path) -> None:
    model = _net(0)
    opt = Muon(split_params(model))
    with pytest.raises(ValueError, match=r"optimizer_state should be 'load' .* or 'fresh' .* but is 'Fresh'"):
        load_checkpoint(tmp_path / "none", model, opt, optimizer_state="Fresh")
    with pytest.raises(
        ValueError, match=r"optimizer_state='fresh' restarts the optimizer .* none was passed"
    ):
        load_checkpoint(tmp_path / "none", model, optimizer_state="fresh")


def test_safetensors_into_a_sharded_model_equals_the_whole_model_load(tmp_path: Path) -> None:
    source = _net(3)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "model.safetensors")
    )
    whole = _net(0)
    load_safetensors(whole, tmp_path)
    assert _equal(_weights(whole), _weights(source))
    results = run_ranks(from_safetensors, 2, str(tmp_path), timeout=TIMEOUT)
    total = sum(p.numel() for p in source.parameters())
    assert sum(r["read"] for r in results) == total, "each element is read from the file by one rank"
    for rank, r in enumerate(results):
        assert r["read"] <= 0.6 * total, (rank, r["read"], total)
        assert _equal(r["plain"], _weights(whole)) and _equal(r["wrapped"], _weights(whole)), rank


@pytest.mark.parametrize(
    ("world", "mesh_shape", "names"), [(2, (2,), ("tp",)), (4, (2, 2), ("dp", "tp"))], ids=["tp", "fsdp_tp"]
)
def test_safetensors_into_tensor_parallel_layouts(
    world: int, mesh_shape: tuple[int, ...], names: tuple[str, ...], tmp_path: Path
) -> None:
    """Column- and row-wise TP shards, and FSDP over TP (interleaved ``_StridedShard`` rows)."""
    torch.manual_seed(3)
    source = MLP()
    save_file(dict(source.state_dict()), str(tmp_path / "model.safetensors"))
    results = run_ranks(mlp_from_safetensors, world, str(tmp_path), mesh_shape, names, timeout=TIMEOUT)
    for rank, weights in enumerate(results):
        assert _equal(weights, _weights(source)), rank


def test_bad_safetensors_name_the_fqn_and_load_nothing(tmp_path: Path) -> None:
    good = {k: v.contiguous() for k, v in _net(3).state_dict().items()}
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "layers.2.bias"}, r"Missing from the files: layers\.2\.bias\."),
        "unexpected": ({**good, "layers.9.weight": torch.ones(2)}, r"Unexpected in the files: layers\.9\.weight\."),
        "shape": ({**good, "layers.3.weight": torch.ones(24, 25)}, r"layers\.3\.weight: \(24, 25\) in the files, \(24, 24\)"),
    }  # fmt: skip
    for name, (tensors, _) in cases.items():
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    results = run_ranks(bad_safetensors, 2, str(tmp_path), sorted(cases), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        for name, (_, pattern) in cases.items():
            kind, message, untouched = r[name]
            assert kind == "CheckpointError" and untouched, (rank, name, kind, message)
            assert re.search(pattern, message), (name, message)


def test_safetensors_fill_persistent_buffers_not_others(tmp_path: Path) -> None:
    """What ``state_dict`` holds is what a file holds: persistent buffers load (BatchNorm's running
    statistics), a non-persistent buffer is neither expected in the file nor changed."""
    source, target = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    source(torch.randn(8, 4))  # running statistics move from their initial values
    for m, value in ((source, 1.0), (target, 2.0)):
        m.register_buffer("scale", torch.full((4,), value), persistent=False)
    save_file(dict(source.state_dict()), str(tmp_path / "model.safetensors"))
    load_safetensors(target, tmp_path)
    assert _equal(dict(target.state_dict()), dict(source.state_dict()))
    assert torch.equal(target.get_buffer("scale"), torch.full((4,), 2.0))


@pytest.mark.integration
def test_llama_save_pretrained_into_a_sharded_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.integrations.test_hf_llama import config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    model.save_pretrained(tmp_path)  # model.safetensors, offline
    assert (tmp_path / "model.safetensors").is_file()
    expected = {n: p.detach() for n, p in model.named_parameters()}
    loaded = run_ranks(llama_from_safetensors, 2, str(tmp_path), timeout=TIMEOUT)
    for rank, weights in enumerate(loaded):
        assert weights.keys() == expected.keys(), rank
        for name, p in expected.items():
            assert torch.equal(weights[name], p), (rank, name)


@pytest.mark.parametrize("saved_wrapped", [True, False], ids=["wrapped_to_plain", "plain_to_wrapped"])
def test_wrapped_and_plain_checkpoints_are_interchangeable_on_two_ranks(
    saved_wrapped: bool, tmp_path: Path
) -> None:
    results = run_ranks(wrapped_round_trip, 2, str(tmp_path), saved_wrapped, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["weights"] and r["state"], f"rank {rank}: the load is not the saved state bitwise"
        assert r["names_kept"], f"rank {rank}: the loaded optimizer's param_names changed"
        assert r["next_step"], f"rank {rank}: the step after the load differs"
    folder = tmp_path / "step_00000002"
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    assert not [k for k in keys if any(w in k for w in WRAPPERS)]
    # settings keyed by the unwrapped FQN; param_names are not saved (a load keeps the optimizer's own)
    assert "optimizer.param_groups.layers.0.weight.lr" in keys
    assert not [k for k in keys if k.endswith(".param_names")]


def test_compiled_model_runs_saves_and_loads_as_the_plain_one(tmp_path: Path) -> None:
    """One process, compiled code running (dynamo, eager backend): train the compiled model, load
    its checkpoint into the plain model, and the plain model's checkpoint back into a compiled one."""
    x = torch.arange(6).reshape(2, 3)
    compiled, opt = _with_muon(_net(0, wrapped=True))
    for _ in range(2):
        opt.zero_grad()
        compiled(x).square().mean().backward()
        opt.step()
    save_checkpoint(tmp_path / "a", 2, compiled, opt)
    plain, plain_opt = _with_muon(_net(1))
    load_checkpoint(tmp_path / "a", plain, plain_opt)
    assert _equal(_weights(plain), _weights(compiled)) and _equal(
        _states(plain, plain_opt), _states(compiled, opt)
    )
    save_checkpoint(tmp_path / "b", 2, plain, plain_opt)
    again, again_opt = _with_muon(_net(2, wrapped=True))
    load_checkpoint(tmp_path / "b", again, again_opt)
    assert torch.equal(again(x), plain(x)) and _equal(_states(again, again_opt), _states(plain, plain_opt))


# Rank functions (run by tests.harness.ranks in every rank of the pool).


def switch_to_muon(root: str, source: str) -> dict[str, Any]:
    """Two AdamW steps saved at step 2 (with AdamW's state, or weights only); then a Muon run loads
    it: refused by default, fresh on request, then one step."""
    world = dist.get_world_size()
    model = _net(3, world)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, adamw, range(2))
    save_checkpoint(root, 2, model, adamw if source == "adamw" else None)
    target, opt = _with_muon(_net(7, world))
    before = _weights(target)
    refused = _error(lambda: load_checkpoint(root, target, opt))
    untouched = _equal(before, _weights(target))
    with mock.patch.object(loading.log, "warning", wraps=loading.log.warning) as warning:
        info = load_checkpoint(root, target, opt, optimizer_state="fresh")
    loaded, states = _weights(target), _states(target, opt)
    _step(target, opt, range(7, 8))
    return {
        "refused": refused,
        "untouched": untouched,
        "info": info,
        "loaded": loaded,
        "zero_state": all(not v.any() for v in states.values()),
        "state_keys": sorted({k.rsplit(":", 1)[1] for k in states}),
        "logged": sum("optimizer starts fresh" in c.args[0] for c in warning.call_args_list),
        "stepped": _weights(target),
    }


def _counting_open(read: list[int]) -> Any:
    """``safe_open`` whose slices add the elements each read returns to ``read[0]``."""
    original = st.safe_open

    def counted(piece: Any) -> Any:
        def get(index: Any) -> torch.Tensor:
            out = piece[index]
            read[0] += out.numel()
            return out

        return mock.MagicMock(get_shape=piece.get_shape, __getitem__=mock.Mock(side_effect=get))

    @contextlib.contextmanager
    def opened(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with original(*args, **kwargs) as f:
            yield mock.Mock(keys=f.keys, get_slice=lambda name: counted(f.get_slice(name)))

    return opened


def from_safetensors(folder: str) -> dict[str, Any]:
    """Load into a plain and a wrapped FSDP2 model; count the elements this rank read (plain)."""
    world = dist.get_world_size()
    read = [0]
    plain = _net(0, world)
    with mock.patch.object(st, "safe_open", _counting_open(read)):
        load_safetensors(plain, folder)
    wrapped = _net(0, world, wrapped=True)
    load_safetensors(wrapped, Path(folder) / "model.safetensors")
    return {"read": read[0], "plain": _weights(plain), "wrapped": _weights(wrapped)}


def mlp_from_safetensors(folder: str, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    torch.manual_seed(5)
    model = shard_mlp(MLP(), mesh_shape, names)
    load_safetensors(model, folder)
    return _weights(model)


def bad_safetensors(root: str, cases: list[str]) -> dict[str, tuple[str, str, bool]]:
    model = _net(0, dist.get_world_size())
    before = _weights(model)
    out = {}
    for case in cases:
        kind, message = _error(lambda case=case: load_safetensors(model, Path(root) / case))
        out[case] = (kind, message, _equal(before, _weights(model)))
    return out


def llama_from_safetensors(folder: str) -> dict[str, torch.Tensor]:
    from tests.integrations.test_hf_llama import build as fsdp_llama  # fully_shard per decoder layer

    model = fsdp_llama(seed=5)  # other initial values: the load must replace every one
    load_safetensors(model, folder)
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def wrapped_round_trip(root: str, saved_wrapped: bool) -> dict[str, bool]:
    """Save a (wrapped or plain) FSDP2 run at step 2, load it into the other kind, step both once.
    The groups come from split_params with a pattern, which must split both kinds alike."""
    world = dist.get_world_size()
    source, opt = _with_muon(_net(0, world, wrapped=saved_wrapped), adamw=("layers.3.weight",))
    _step(source, opt, range(2))
    save_checkpoint(root, 2, source, opt)
    target, target_opt = _with_muon(_net(7, world, wrapped=not saved_wrapped), adamw=("layers.3.weight",))
    names = [list(g["param_names"]) for g in target_opt.param_groups]
    load_checkpoint(root, target, target_opt)
    result = {
        "weights": _equal(_weights(target), _weights(source)),
        "state": _equal(_states(target, target_opt), _states(source, opt)),
        "names_kept": names == [g["param_names"] for g in target_opt.param_groups],
    }
    _step(source, opt, range(2, 3))
    _step(target, target_opt, range(2, 3))
    result["next_step"] = _equal(_weights(target), _weights(source))
    return result
