"""What a load spends parsing DCP's ``.metadata``: one checked parse (``read_metadata``: pickle's C
unpickler, with stand-ins made for each parse) of synthetic metadata of E entries each sharded into C
chunks, as a run of C ranks writes it, beside the checked parse before (Python's own unpickler with
BUILD limited to DCP's records, copied here as it was) and a plain ``pickle.loads`` of the same bytes.
``load_checkpoint`` parses it once a load (three times before issue 50's round 9; the count is
``tests/checkpoint/test_checkpoint_trust.py::test_a_load_parses_the_metadata_once``'s). Process time,
so other work on the host does not count.

    python benchmarks/bench_load_metadata.py --out benchmarks/results/load_metadata.json
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import pickle
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import least_cpu_seconds, results_config, system_info  # noqa: E402
from muon_dtensor.base.torch_dist import dcp_records  # noqa: E402
from muon_dtensor.checkpoint import safe_read  # noqa: E402
from muon_dtensor.checkpoint.safe_read import read_metadata  # noqa: E402

STORAGE_INFO = dcp_records()[0]
# (entries, chunks per entry = ranks); 1,600 entries is about Llama-3-70B's weights and optimizer
# state (723 parameters, 560 momenta, 326 AdamW moments) over a shard group of 256
SIZES = [(100, 8), (200, 64), (400, 256), (1600, 256)]


def metadata(entries: int, ranks: int) -> Metadata:
    """E row-sharded 1,024-column matrices, one chunk per rank, one file per rank."""
    tensors: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for e in range(entries):
        fqn = f"model.layers.{e}.weight"
        offsets = [torch.Size([r * 16, 0]) for r in range(ranks)]
        chunks = [ChunkStorageMetadata(offsets=o, sizes=torch.Size([16, 1024])) for o in offsets]
        tensors[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([16 * ranks, 1024]), chunks
        )
        for r, o in enumerate(offsets):
            storage[MetadataIndex(fqn, o, r)] = STORAGE_INFO(f"__{r}_0.distcp", e * 65536, 65536)
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


_BEFORE_ALLOWED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__name__): c for c in (*safe_read._RECORDS, safe_read._MEM_FORMAT_ENCODING)},
    **{("pathlib", name): getattr(pathlib, name) for name in safe_read._PATHS},
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): safe_read._GET_LAYOUT,
    ("collections", "OrderedDict"): OrderedDict,
}


class PythonUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The checked parse before: Python's own unpickler, the allow-list, BUILD on records only."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _BEFORE_ALLOWED:
            return _BEFORE_ALLOWED[(module, name)]
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise ValueError(f"{module}.{name}")

    def _build(self) -> None:
        if type(self.stack[-2]) not in safe_read._RECORDS:
            raise ValueError(f"BUILD on a {type(self.stack[-2]).__name__}")
        pickle._Unpickler.dispatch[pickle.BUILD[0]](self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="the least of this many runs per figure")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/load_metadata.json")
    args = parser.parse_args()
    print(
        "| entries x chunks | .metadata MB | checked parse (CPU s) | checked parse before (CPU s) "
        "| plain pickle.loads (CPU s) | checked / before | checked / plain |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for entries, ranks in SIZES:
        row = measure(entries, ranks, args.repeat)
        rows.append(row)
        print(
            f"| {entries} x {ranks} | {row['bytes'] / 1e6:.1f} | {row['checked_s']:.3f} | {row['before_s']:.3f} "
            f"| {row['plain_s']:.3f} | {row['checked_s'] / row['before_s']:.2f} "
            f"| {row['checked_s'] / row['plain_s']:.2f} |"
        )
    results = {"config": results_config(args), "system": system_info(), "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")


def measure(entries: int, ranks: int, repeat: int) -> dict[str, Any]:
    """CPU s of a checked parse, of the one before and of a plain one, and the file's bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = pickle.dumps(metadata(entries, ranks))
        (folder / ".metadata").write_bytes(data)
        files = {f"__{r}_0.distcp" for r in range(ranks)}
        checked = least_cpu_seconds(lambda: read_metadata(folder, files), repeat)
        before = least_cpu_seconds(lambda: PythonUnpickler(io.BytesIO(data)).load(), repeat)
        plain = least_cpu_seconds(lambda: pickle.loads(data), repeat)
    return {
        "entries": entries,
        "chunks": ranks,
        "bytes": len(data),
        "checked_s": checked,
        "before_s": before,
        "plain_s": plain,
    }


if __name__ == "__main__":
    main()
