"""A checkpoint folder is data: reading it never runs code, and every public reader checks it first.

Whoever can write a step folder can also re-sign its manifest (the checksums are unkeyed), so these
tests re-sign what they edit: the readers must refuse the content itself. Payloads are harmless:
unpickling ``_Mkdir`` creates a marker folder, which must never appear.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

import muon_dtensor.checkpoint as ckpt
from muon_dtensor.checkpoint import safe_read
from muon_dtensor.checkpoint.manifest import MANIFEST, file_record, read_manifest
from muon_dtensor.checkpoint.safe_read import read_metadata
from tests.checkpoint.test_titan_entries import _titan_folder
from tests.helpers.models import state_copy, trained_net


class _Mkdir:
    """Unpickling this creates ``path``: proof that reading a file ran code of the file's choosing."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def _metadata(folder: Path) -> Any:
    """DCP's metadata of a folder this test wrote itself (so unpickling it freely is safe)."""
    return pickle.loads((folder / ".metadata").read_bytes())


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _sign(folder: Path, content: dict[str, Any]) -> None:
    """What anyone who can write the folder can do: a manifest with a valid checksum for any content."""
    body = json.dumps(content, indent=1, sort_keys=True)
    checksum = "sha256:" + hashlib.sha256(body.encode()).hexdigest()
    (folder / MANIFEST).write_text(json.dumps({**content, "checksum": checksum}, indent=1, sort_keys=True))


def _resign(folder: Path) -> None:
    """New checksums for the folder's edited files."""
    content = read_manifest(folder)
    content["files"] = {name: file_record(folder / name) for name in content["files"]}
    _sign(folder, content)


def _load_error(root: Path, marker: Path | None = None) -> str:
    """Load into a fresh model: a CheckpointError (an Exception) with the model untouched, no marker."""
    model, opt = trained_net(1)
    before = state_copy(model)
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.load_checkpoint(root, model, opt)
    assert _unchanged(model, before)
    assert marker is None or not marker.exists(), "the checkpoint ran code"
    return str(caught.value)


@pytest.fixture(scope="module")
def _saved_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's one save: a root with step 1 of a trained Net and its Muon (two param groups)."""
    model, opt = trained_net()
    root = tmp_path_factory.mktemp("trust") / "root"
    ckpt.save_checkpoint(root, 1, model, opt, extra={"data_step": 3})
    return root


@pytest.fixture
def saved(_saved_once: Path, tmp_path: Path) -> Path:
    """A copy of the module's save for this test to tamper with (file for file, as saved)."""
    shutil.copytree(_saved_once, tmp_path / "root")
    return tmp_path / "root"


# ------------------------------------------------------------------------- nothing may execute


def _poisoned_metadata(folder: Path, marker: Path) -> None:
    """A real ``.metadata`` with a payload inside it (where DCP keeps planner data)."""
    metadata = _metadata(folder)
    metadata.planner_data = _Mkdir(marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("resigned", [True, False])
def test_a_metadata_payload_never_runs_in_load_checkpoint(saved: Path, resigned: bool) -> None:
    folder, marker = saved / "step_00000001", saved.parent / "ran"
    _poisoned_metadata(folder, marker)
    if resigned:
        _resign(folder)
    message = _load_error(saved, marker)
    expected = "posix.mkdir" if resigned else "failed verification"  # edited without re-signing
    assert expected in message and ".metadata" in message


@pytest.mark.parametrize("resigned", [True, False])
def test_a_metadata_payload_never_runs_in_export(saved: Path, tmp_path: Path, resigned: bool) -> None:
    folder, marker = saved / "step_00000001", tmp_path / "ran"
    _poisoned_metadata(folder, marker)
    if resigned:
        _resign(folder)
    with pytest.raises(
        ckpt.CheckpointError, match="posix.mkdir" if resigned else r"\.metadata: .* \(truncated\?\)"
    ):
        ckpt.export_safetensors(folder, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_pickled_param_group_entry_never_runs(tmp_path: Path) -> None:
    """A save writes a valid manifest for whatever the groups hold: here an ``lr`` that is a payload."""
    marker = tmp_path / "ran"
    model, opt = trained_net()
    opt.param_groups[0]["lr"] = _Mkdir(marker)
    ckpt.save_checkpoint(tmp_path / "root", 1, model, opt)
    shutil.rmtree(marker, ignore_errors=True)  # a deepcopy inside the save may have run it here
    message = _load_error(tmp_path / "root", marker)
    assert "optimizer.param_groups.layers.0.weight.lr" in message and "__0_0.distcp" in message


@pytest.mark.parametrize(
    "reader", ["load_checkpoint", "load_checkpoint of torchtitan's", "export_safetensors"]
)
def test_a_load_parses_the_metadata_once(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """The checks and DCP's reader share one parse, so DCP reads by the metadata that was checked,
    not by the file read again after the checks. It was three parses a load (the lr kinds, the
    checks, the reader), four for a torchtitan folder (its entries beside the weights) and two an
    export; one takes 1.9 CPU s at 400 entries x 256 chunks (docs/benchmarks.md)."""
    titan = _titan_folder(tmp_path / "titan", {"train_state": {"step": 3}})
    parses = []
    parse = safe_read._MetadataUnpickler.load

    def counted(self: Any) -> Any:
        parses.append(self)
        return parse(self)

    monkeypatch.setattr(safe_read._MetadataUnpickler, "load", counted)
    if reader == "export_safetensors":
        ckpt.export_safetensors(saved / "step_00000001", tmp_path / "out")
    else:
        model, opt = trained_net(1)
        ckpt.load_checkpoint(saved if reader == "load_checkpoint" else titan, model, opt)
    assert len(parses) == 1, f"{len(parses)} parses of .metadata in one {reader}"


def test_a_load_reads_each_entry_once(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks read every non-tensor entry the load reads (a refused one fails before anything
    loads), and DCP's load puts those in as they were checked instead of reading each again: 23
    param-group entries per parameter, a ``torch.load`` of 130 us each (twice a load before)."""
    reads: list[str] = []
    load_bytes = safe_read.SafeLoadPlanner.load_bytes

    def counted(self: Any, read_item: Any, value: Any) -> None:
        reads.append(read_item.dest_index.fqn)
        load_bytes(self, read_item, value)

    monkeypatch.setattr(safe_read.SafeLoadPlanner, "load_bytes", counted)
    model, opt = trained_net(1)
    ckpt.load_checkpoint(saved, model, opt)
    twice = sorted({fqn for fqn in reads if reads.count(fqn) > 1})
    assert reads and not twice, f"read more than once: {twice[:5]} ({len(twice)} entries)"
    assert any(fqn.endswith(".lr") for fqn in reads) and opt.param_groups[0]["lr"] == 0.02


_SET_PATCHED = b"N}X\x07\x00\x00\x00patchedK\x01s\x86b"  # BUILD: (None, {"patched": 1}), by setattr
_SHARED = {  # what a pickle can name that the whole process shares, and how it reaches it
    "a record class": (b"c" + Metadata.__module__.encode() + b"\nMetadata\n", lambda: Metadata),
    "a path class": (b"cpathlib\nPosixPath\n", lambda: pathlib.PosixPath),
    "the layout function": (b"ctorch.serialization\n_get_layout\n", lambda: safe_read._GET_LAYOUT),
    "a memory-format member": (
        b"c" + Metadata.__module__.encode() + b"\n_MEM_FORMAT_ENCODING\nK\x00\x85R",
        lambda: safe_read._MEM_FORMAT_ENCODING(0),
    ),
}


@pytest.mark.parametrize("shared", list(_SHARED))
@pytest.mark.parametrize("state", [_SET_PATCHED, b"}X\x07\x00\x00\x00patchedK\x01sb"], ids=["slots", "dict"])
def test_metadata_cannot_set_attributes_on_what_the_process_shares(
    saved: Path, shared: str, state: bytes
) -> None:
    """A BUILD on a class, function or enum member the metadata may name would patch it for the
    whole process: the parse hands the pickle stand-ins made for it, and refuses the result."""
    folder = saved / "step_00000001"
    opcodes, target = _SHARED[shared]
    (folder / ".metadata").write_bytes(b"\x80\x02" + opcodes + state + b".")
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: not DCP metadata"):
        read_metadata(folder)
    assert not hasattr(target(), "patched") and "patched" not in getattr(target(), "__dict__", {})


def test_metadata_naming_a_file_the_manifest_does_not_check_is_refused(saved: Path, tmp_path: Path) -> None:
    """DCP reads the files ``.metadata`` names; each must be one the manifest checked."""
    folder = saved / "step_00000001"
    metadata = _metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    shutil.copy(folder / "__0_0.distcp", saved / "outside.distcp")
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _resign(folder)
    assert "'../outside.distcp'" in _load_error(saved)
    with pytest.raises(ckpt.CheckpointError, match="outside.distcp"):
        ckpt.export_safetensors(folder, tmp_path / "out")


# ------------------------------------------------------------------------- the manifest's own claims


@pytest.mark.parametrize("name", ["../outside.distcp", "/abs/outside.distcp", "sub/__0_0.distcp", ".."])
def test_manifest_entries_outside_the_step_folder_are_refused(saved: Path, name: str) -> None:
    folder = saved / "step_00000001"
    shutil.copy(folder / "__0_0.distcp", saved / "outside.distcp")
    content = read_manifest(folder)
    content["files"][name] = file_record(folder / "__0_0.distcp")  # a valid record: only the name is wrong
    _sign(folder, content)
    message = _load_error(saved)
    assert f"{name!r}" in message and "not a file name of the step folder" in message


@pytest.mark.parametrize("depth", [600, 100_000])
def test_a_deeply_nested_manifest_is_a_checkpoint_error(saved: Path, depth: int) -> None:
    path = saved / "step_00000001" / MANIFEST
    path.write_text('{"files": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ckpt.CheckpointError, match=MANIFEST):
        read_manifest(path.parent)
    assert MANIFEST in _load_error(saved)


def test_a_manifest_of_another_step_is_refused(saved: Path) -> None:
    """A step folder copied over another (an old state under a newer name) does not load."""
    shutil.copytree(saved / "step_00000001", saved / "step_00000005")
    message = _load_error(saved)
    assert "step_00000005" in message and "step 1" in message
    with pytest.raises(ckpt.CheckpointError, match="step 1"):
        ckpt.latest_step(saved)


def test_a_manifest_without_the_metadata_entry_is_refused(saved: Path) -> None:
    folder = saved / "step_00000001"
    content = read_manifest(folder)
    del content["files"][".metadata"]
    _sign(folder, content)
    assert ".metadata" in _load_error(saved)


@pytest.mark.parametrize(
    ("field", "value"),
    [("files", []), ("files", {"__0_0.distcp": {"bytes": "1"}}), ("step", "1"), ("extra", [])],
)
def test_a_manifest_of_the_wrong_shape_is_refused(saved: Path, field: str, value: Any) -> None:
    folder = saved / "step_00000001"
    content = read_manifest(folder)
    content[field] = value
    _sign(folder, content)
    assert repr(field) in _load_error(saved)


@pytest.mark.parametrize("value", [3, "2", None])
def test_a_manifest_of_an_unknown_format_is_refused_naming_it(saved: Path, value: Any) -> None:
    """Before, any format but 2 was read as format 1, and the error listed the keys it lacked."""
    folder = saved / "step_00000001"
    content = read_manifest(folder)
    content["format"] = value
    _sign(folder, content)
    message = _load_error(saved)
    assert f"'format' is {value!r}" in message and "cannot read" in message, message


# ------------------------------------------------------------------------- export checks what load checks


def test_export_refuses_a_flipped_bit(saved: Path, tmp_path: Path) -> None:
    folder = saved / "step_00000001"
    info = next(v for k, v in _metadata(folder).storage_data.items() if k.fqn == "embed.weight")
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 8] ^= 0x01  # inside embed.weight's values
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        ckpt.export_safetensors(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_of_a_truncated_file_is_a_checkpoint_error(saved: Path, tmp_path: Path) -> None:
    folder = saved / "step_00000001"
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    try:
        ckpt.export_safetensors(folder, tmp_path / "out")
    except Exception as e:  # DCP's CheckpointException derives from BaseException: it must not escape
        assert isinstance(e, ckpt.CheckpointError) and "__0_0.distcp: 1000 bytes" in str(e)
    else:
        raise AssertionError("a truncated checkpoint exported")


def test_export_of_the_root_names_a_step_folder(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointError, match=r"is a checkpoint root.*step_00000001"):
        ckpt.export_safetensors(saved, tmp_path / "out")
    with pytest.raises(ckpt.CheckpointError, match=r"no manifest\.json"):
        ckpt.export_safetensors(tmp_path, tmp_path / "out")


def test_export_still_writes_what_load_reads(saved: Path, tmp_path: Path) -> None:
    files = ckpt.export_safetensors(saved / "step_00000001", tmp_path / "out")
    model, _ = trained_net(1)
    ckpt.load_safetensors(model, tmp_path / "out")
    assert files == [tmp_path / "out" / "model.safetensors"] and _unchanged(
        model, state_copy(trained_net()[0])
    )


def test_latest_step_checks_the_newest_manifest_and_the_root(saved: Path) -> None:
    assert ckpt.latest_step(saved) == 1
    with pytest.raises(
        ckpt.CheckpointError, match=r"is a step folder, not a checkpoint root.*pass its parent"
    ):
        ckpt.latest_step(saved / "step_00000001")
    path = saved / "step_00000001" / MANIFEST
    path.write_text(path.read_text().replace('"data_step": 3', '"data_step": 4'))
    with pytest.raises(ckpt.CheckpointError, match="manifest fails its checksum"):
        ckpt.latest_step(saved)


def test_load_checkpoint_of_a_step_folder_names_the_root(saved: Path) -> None:
    """It used to return None, as for an empty root: a silent fresh start."""
    assert "pass its parent" in _load_error(saved / "step_00000001")


# ------------------------------------------------------------------------- load_safetensors checks first


def _exported(tmp_path: Path) -> Path:
    model, _ = trained_net()
    out = tmp_path / "st"
    out.mkdir()
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:3]}, str(out / "a.safetensors"))
    save_file({k: tensors[k] for k in names[3:]}, str(out / "b.safetensors"))
    weight_map = {k: "a.safetensors" if i < 3 else "b.safetensors" for i, k in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def _safetensors_error(folder: Path) -> str:
    model, _ = trained_net(1)
    before = state_copy(model)
    with pytest.raises(ckpt.CheckpointError) as caught:
        ckpt.load_safetensors(model, folder)
    assert _unchanged(model, before)
    return str(caught.value)


def test_load_safetensors_refuses_a_truncated_file(tmp_path: Path) -> None:
    out = _exported(tmp_path)
    ckpt.load_safetensors(trained_net(1)[0], out)  # the good files load
    (out / "b.safetensors").write_bytes((out / "b.safetensors").read_bytes()[:-10])
    assert "b.safetensors" in _safetensors_error(out)


@pytest.mark.parametrize("target", ["../a.safetensors", "/tmp/a.safetensors", "missing.safetensors"])
def test_load_safetensors_refuses_an_index_naming_other_files(tmp_path: Path, target: str) -> None:
    out = _exported(tmp_path)
    shutil.copy(out / "a.safetensors", tmp_path / "a.safetensors")
    index = out / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"] = {
        k: target if v == "a.safetensors" else v for k, v in content["weight_map"].items()
    }
    index.write_text(json.dumps(content))
    assert repr(target) in _safetensors_error(out)


def test_load_safetensors_refuses_a_broken_index(tmp_path: Path) -> None:
    out = _exported(tmp_path)
    index = out / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-5])
    assert "model.safetensors.index.json" in _safetensors_error(out)
    index.write_text(json.dumps({"weight_map": {"embed.weight": "b.safetensors"}}))
    assert "embed.weight" in _safetensors_error(out) and "b.safetensors" in _safetensors_error(out)
