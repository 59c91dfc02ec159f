"""What a save accepts and what a manifest proves: ``extra`` must come back exactly as saved (else the
save is refused naming the key, before any file is written, on every rank and before any collective),
``keep_last`` is None or at least 1 and never deletes the newest step or the one just saved, and a
manifest with any byte flipped is refused."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint.manifest import MANIFEST, read_manifest
from tests.harness.ranks import run_ranks
from tests.helpers.models import Net, build

TIMEOUT = 60.0  # seconds per multi-rank call; a rank that waits in a collective fails the test


FORMAT1 = (
    Path(__file__).resolve().parents[1] / "data" / "format1"
)  # written by 0.2.0 (tests/data/make_format1.py)


def _net(seed: int = 0) -> tuple[nn.Module, Muon]:
    torch.manual_seed(seed)
    model = Net()
    return model, Muon(split_params(model), lr=0.02)


# ----------------------------------------------------------------------------------- extra

REFUSED: dict[str, tuple[Any, type[Exception], str]] = {
    "meta_tensor": (
        {"w": torch.ones(2, device="meta")},
        ValueError,
        r"extra\['w'\] is a Tensor on meta: extra holds plain dense tensors",
    ),
    "nested_sparse_tensor": (
        {"a": [1, {"b": torch.ones(2).to_sparse()}]},
        ValueError,
        r"extra\['a'\]\[1\]\['b'\] is a Tensor on cpu: extra holds plain dense tensors",
    ),
    "placeholder_key": (
        {"a": {"__tensor__": 0}},
        ValueError,
        r"extra\['a'\]: the key '__tensor__' is reserved",
    ),
    "int_key": ({"rng": {3: "x"}}, TypeError, r"extra\['rng'\]: the key 3 is of type int; JSON keys are str"),
    "step_key": ({"step": 999}, ValueError, r"extra\['step'\]: the key 'step' is reserved"),
    "nan": ({"loss": math.nan}, ValueError, r"extra\['loss'\] is nan; JSON has no NaN or infinity"),
    "infinity": ({"best": [1.0, -math.inf]}, ValueError, r"extra\['best'\]\[1\] is -inf"),
    "tuple": ({"shape": (2, 3)}, TypeError, r"extra\['shape'\] is of type tuple, .*; use a list"),
    "not_a_dict": ([1, 2], TypeError, r"extra should be a dict but is of type list"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_extra_that_json_would_change_is_refused_before_any_write(case: str, tmp_path: Path) -> None:
    extra, error, pattern = REFUSED[case]
    model, opt = _net()
    with pytest.raises(error, match=pattern):
        ckpt.save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    with pytest.raises(error, match=pattern):
        ckpt.async_save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    assert list(tmp_path.iterdir()) == []


def test_extra_comes_back_exactly(tmp_path: Path) -> None:
    extra = {
        "data": {"position": 12345678901234567890, "files": ["a", "b"], "done": False},
        "lr": 0.1 + 0.2,
        "tiny": 5e-324,
        "none": None,
        "unicode": "é→∞",
        "nested": [[], {}, [1.5, -0.0, True]],
    }
    model, opt = _net()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    info = ckpt.load_checkpoint(tmp_path, *_net(1))
    assert info is not None and info.pop("step") == 1
    assert info == extra and json.dumps(info, sort_keys=True) == json.dumps(extra, sort_keys=True)
    assert math.copysign(1.0, info["nested"][2][1]) == -1.0  # -0.0 kept its sign


def test_tensors_in_extra_come_back_exactly(tmp_path: Path) -> None:
    """``save_checkpoint(extra={"rng": torch.get_rng_state()})`` raised a JSON TypeError, though
    docs/resume.md tells a loop to restore its RNG state. Tensors are now DCP entries of the
    checkpoint (read as data), in their dtype, at any depth of extra."""
    torch.manual_seed(5)
    extra: dict[str, Any] = {
        "rng": torch.get_rng_state(),
        "nested": [{"t": torch.randn(3, 2).double()}, 7],
        "n": torch.tensor(3),
    }
    model, opt = _net()
    ckpt.save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    info = ckpt.load_checkpoint(tmp_path, *_net(1))
    assert info is not None and info["nested"][1] == 7
    for got, want in (
        (info["rng"], extra["rng"]),
        (info["nested"][0]["t"], extra["nested"][0]["t"]),
        (info["n"], extra["n"]),
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)
    torch.set_rng_state(info["rng"])
    restored = torch.rand(4)
    torch.manual_seed(5)  # the state the save took
    assert torch.equal(restored, torch.rand(4))  # the loaded state restores the generator exactly


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP's, one process
def test_an_async_save_keeps_extra_as_it_was_at_the_call(tmp_path: Path) -> None:
    model, opt = _net()
    extra: dict[str, Any] = {"data": {"position": 8}}
    pending = ckpt.async_save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    extra["data"]["position"] = 16  # training goes on while the save is in flight
    pending.wait()
    assert ckpt.load_checkpoint(tmp_path, *_net(1)) == {"step": 1, "data": {"position": 8}}


# ----------------------------------------------------------------------------------- step, keep_last


@pytest.mark.parametrize(
    ("keep_last", "step"), [(-1, 4), (0, 4), (True, 4), (1.5, 4), (None, -1), (None, True), (None, "4")]
)
def test_keep_last_below_one_and_bad_steps_are_refused_before_any_write(
    keep_last: Any, step: Any, tmp_path: Path
) -> None:
    model, opt = _net()
    for s in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, s, model, opt)
    name = "keep_last" if step == 4 else "step"
    with pytest.raises(ValueError, match=rf"{name} should be .*but is {keep_last if step == 4 else step!r}"):
        ckpt.save_checkpoint(tmp_path, step, model, opt, keep_last=keep_last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001", "step_00000002", "step_00000003"]


def test_keep_last_keeps_the_newest_step_and_the_one_just_saved(tmp_path: Path) -> None:
    model, opt = _net()
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, opt, keep_last=1)
    assert ckpt.complete_steps(tmp_path) == [3]
    ckpt.save_checkpoint(tmp_path, 2, model, opt, keep_last=1)  # an older step, saved again
    assert ckpt.complete_steps(tmp_path) == [2, 3]
    ckpt.save_checkpoint(tmp_path, 5, model, opt, keep_last=2)
    assert ckpt.complete_steps(tmp_path) == [3, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000005"]


# ----------------------------------------------------------------------------------- the manifest


def _flips(tmp_path: Path) -> tuple[Path, bytes, list[tuple[int, int]]]:
    """A saved step's folder, its manifest's bytes, and every change the flip tests make: each byte's
    8 single-bit flips, all bits flipped, and each JSON whitespace in its place. ``extra`` holds
    what JSON can spell two ways (``1e-05`` / ``1E-05``, ``\u00e9`` / ``\u00e9``), so a flip can
    give the same content in other bytes: refused too, the file is not the one written."""
    model, opt = _net()
    extra = {"data_step": 7, "seed": [1, 2], "lr": 1e-05, "name": "é"}
    folder = ckpt.save_checkpoint(tmp_path, 1, model, opt, extra=extra)
    good = (folder / MANIFEST).read_bytes()
    assert read_manifest(folder)["extra"] == extra and b"1e-05" in good and b"\\u00e9" in good
    changed = [
        (i, v)
        for i in range(len(good))
        for v in sorted({good[i] ^ m for m in (1, 2, 4, 8, 16, 32, 64, 128, 255)} | set(b" \n\t\r"))
        if v != good[i]
    ]
    return folder, good, changed


def _read_back(folder: Path, good: bytes, changed: list[tuple[int, int]]) -> None:
    """Make each change in the written manifest (one byte, in place, then put back); none may read back."""
    silent = []
    with open(folder / MANIFEST, "r+b", buffering=0) as f:
        for i, value in changed:
            f.seek(i)
            f.write(bytes([value]))
            try:
                read_manifest(folder)
            except ckpt.CheckpointError:
                continue
            finally:
                f.seek(i)
                f.write(good[i : i + 1])
            silent.append((i, chr(good[i]), chr(value)))
    assert (folder / MANIFEST).read_bytes() == good
    assert not silent, f"{len(silent)} of {len(changed)} changed bytes read back, the first: {silent[:5]}"


@pytest.mark.slow
def test_every_flipped_bit_and_byte_of_the_manifest_is_refused(tmp_path: Path) -> None:
    """Every change ``_flips`` lists (the fast tier runs a sample: the next test)."""
    _read_back(*_flips(tmp_path))


@pytest.mark.sample_of("test_every_flipped_bit_and_byte_of_the_manifest_is_refused")
def test_a_sample_of_flipped_bits_and_bytes_of_the_manifest_is_refused(tmp_path: Path) -> None:
    """The fast tier's share of the test above: 500 of its changes drawn with a fixed seed, and
    every change of the bytes that spell ``1e-05`` and ``\u00e9``."""
    folder, good, changed = _flips(tmp_path)
    spelled = {good.index(b"1e-05") + j for j in range(5)} | {good.index(b"\\u00e9") + j for j in range(6)}
    sample = set(random.Random(0).sample(changed, 500)) | {(i, v) for i, v in changed if i in spelled}
    _read_back(folder, good, sorted(sample))


def test_a_load_with_a_flipped_manifest_changes_nothing(tmp_path: Path) -> None:
    model, opt = _net()
    folder = ckpt.save_checkpoint(tmp_path, 1, model, opt, extra={"data_step": 7})
    text = (folder / MANIFEST).read_text()
    (folder / MANIFEST).write_text(text.replace('"data_step": 7', '"data_step": 8'))
    fresh, fresh_opt = _net(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match="manifest fails its checksum"):
        ckpt.load_checkpoint(tmp_path, fresh, fresh_opt)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_manifest_written_before_the_checksum_still_loads(tmp_path: Path) -> None:
    """Checkpoints saved by earlier versions: their manifest has no checksum (only its files do).
    Those versions wrote format 1 (tests/data/format1, its checksum taken out here)."""
    shutil.copytree(FORMAT1, tmp_path / "root")
    folder = tmp_path / "root" / "step_00000002"
    content = json.loads((folder / MANIFEST).read_text())
    del content["checksum"]
    (folder / MANIFEST).write_text(json.dumps(content, indent=1, sort_keys=True))
    assert ckpt.load_checkpoint(tmp_path / "root", *_net(1)) == {"step": 2, "data_position": 12}


# ----------------------------------------------------------------------------------- on every rank


@pytest.mark.parametrize("case", ["tensor_extra", "step_key", "keep_last_0", "keep_last_-1"])
def test_bad_arguments_raise_on_every_rank_before_any_write(case: str, tmp_path: Path) -> None:
    """Every rank raises the same error, whether every rank or rank 1 alone passed the bad value:
    the local check's failure travels in the save's one agreement (``checks/together.py``) before
    any file is written, so no rank is left waiting in the save's collectives."""
    (both, alone) = run_ranks(bad_arguments, 2, str(tmp_path), case, timeout=TIMEOUT)[0]
    assert both[0] == both[1] and alone[0] == alone[1], (both, alone)
    assert both[0][0] in ("TypeError", "ValueError"), both
    # on rank 1 alone the value is also a disagreement, named first: "ranks disagree about extra: ..."
    name = next(iter(ARGUMENTS[case]))
    assert alone[0][0] == "ValueError" and f"ranks disagree about {name}" in alone[0][1], alone
    assert list(tmp_path.iterdir()) == []


ARGUMENTS: dict[str, dict[str, Any]] = {
    "tensor_extra": {"extra": {"w": torch.zeros(1, device="meta")}},
    "step_key": {"extra": {"step": 3}},
    "keep_last_0": {"keep_last": 0},
    "keep_last_-1": {"keep_last": -1},
}


def bad_arguments(root: str, case: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Rank function: every rank's error, gathered, with the bad value on every rank; then with it
    on rank 1 alone."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)

    def attempt(bad: bool) -> tuple[str, str]:
        try:
            ckpt.save_checkpoint(root, 1, model, opt, **(ARGUMENTS[case] if bad else {}))
        except Exception as e:  # noqa: BLE001 - the error is the result
            return type(e).__name__, str(e)
        return "ok", ""

    both: list[Any] = [None, None]
    dist.all_gather_object(both, attempt(True))
    alone: list[Any] = [None, None]
    dist.all_gather_object(alone, attempt(dist.get_rank() == 1))
    return both, alone


def per_rank_rng(root: str) -> list[torch.Tensor]:
    """Rank function: each rank saves its own RNG state in extra, then loads it back."""
    model = build((dist.get_world_size(),))
    opt = Muon(split_params(model), lr=0.02)
    torch.manual_seed(100 + dist.get_rank())  # ranks hold other RNG states
    mine = torch.get_rng_state()
    ckpt.save_checkpoint(root, 1, model, opt, extra={"rng": mine})
    info = ckpt.load_checkpoint(root, model, opt)
    assert info is not None
    return [mine, info["rng"]]


def test_each_rank_gets_its_own_rng_state_back_and_fewer_ranks_get_rank_0s(tmp_path: Path) -> None:
    results = run_ranks(per_rank_rng, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    assert not torch.equal(results[0][0], results[1][0])  # the ranks saved other states
    assert all(torch.equal(saved, loaded) for saved, loaded in results)
    model = build(None)
    alone = ckpt.load_checkpoint(tmp_path / "ckpt", model, Muon(split_params(model), lr=0.02))
    assert alone is not None and torch.equal(alone["rng"], results[0][0])  # one rank: rank 0's
