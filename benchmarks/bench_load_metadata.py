"""What a load spends parsing DCP's ``.metadata``: one checked parse (``read_metadata``: the allow-list
unpickler, in Python) of synthetic metadata of E entries each sharded into C chunks, as a run of C
ranks writes it, beside a plain ``pickle.loads`` of the same bytes. ``load_checkpoint`` parsed it
three times a load (the lr kinds, the checks, DCP's reader) and now parses it once (the count is
``tests/checkpoint/test_checkpoint_trust.py::test_a_load_parses_the_metadata_once``'s), so a load's
parsing is three of these parses before and one after. Process time, so other work on the host does
not count.

    python benchmarks/bench_load_metadata.py --out benchmarks/results/load_metadata.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="the least of this many runs per figure")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/load_metadata.json")
    args = parser.parse_args()
    print(
        "| entries x chunks | .metadata MB | checked parse (CPU s) | plain pickle.loads (CPU s) | checked / plain |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for entries, ranks in SIZES:
        checked, plain, size = measure(entries, ranks, args.repeat)
        rows.append(
            {"entries": entries, "chunks": ranks, "bytes": size, "checked_s": checked, "plain_s": plain}
        )
        print(
            f"| {entries} x {ranks} | {size / 1e6:.1f} | {checked:.3f} | {plain:.3f} | {checked / plain:.1f} |"
        )
    results = {"config": results_config(args), "system": system_info(), "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")


def measure(entries: int, ranks: int, repeat: int) -> tuple[float, float, int]:
    """CPU s of a checked parse and of a plain one, and the file's bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = pickle.dumps(metadata(entries, ranks))
        (folder / ".metadata").write_bytes(data)
        files = {f"__{r}_0.distcp" for r in range(ranks)}
        checked = least_cpu_seconds(lambda: read_metadata(folder, files), repeat)
        return checked, least_cpu_seconds(lambda: pickle.loads(data), repeat), len(data)


if __name__ == "__main__":
    main()
