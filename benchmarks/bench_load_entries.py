"""What a load spends on a checkpoint's non-tensor entries. DCP saves an optimizer's param groups per
parameter (torch's ``get_optimizer_state_dict``: 23 entries each for Muon, every one a ``torch.save``),
and ``load_checkpoint`` reads each with ``torch.load(weights_only=True)``. Its checks read every entry
the load reads, so a refused one fails before anything loads; DCP's load then read each again. Now
the load puts in the entries as they were checked (``SafeLoadPlanner(read=...)``; the count is
``tests/checkpoint/test_checkpoint_trust.py::test_a_load_reads_each_entry_once``'s). Side by side in
one process (gloo, one rank): ``load_checkpoint`` as it is, and with the planner reading the entries
again (the load before). Process time, the least of ``--repeat`` loads.

    python benchmarks/bench_load_entries.py --out benchmarks/results/load_entries.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import least_cpu_seconds, results_config, system_info  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from muon_dtensor.checkpoint.safe_read import SafeLoadPlanner, read_metadata  # noqa: E402

LAYERS = [50, 200]  # Linear(64, 64) layers: a weight (Muon) and a bias (AdamW) each


def trained(layers: int) -> tuple[nn.Module, Muon]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(layers)))
    opt = Muon(split_params(model), lr=0.02)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def measure(layers: int, repeat: int) -> dict[str, float | int]:
    """CPU s of a load as it is and with the entries read again; the checkpoint's entry counts."""
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), 1, *trained(layers))
        entries = read_metadata(Path(tmp, "step_00000001")).state_dict_metadata.values()
        model, opt = trained(layers)
        once = least_cpu_seconds(lambda: load_checkpoint(tmp, model, opt), repeat)
        mine = SafeLoadPlanner.create_local_plan
        SafeLoadPlanner.create_local_plan = DefaultLoadPlanner.create_local_plan  # type: ignore[method-assign]
        try:
            twice = least_cpu_seconds(lambda: load_checkpoint(tmp, model, opt), repeat)
        finally:
            SafeLoadPlanner.create_local_plan = mine  # type: ignore[method-assign]
    return {
        "parameters": 2 * layers,
        "entries": sum(type(e) is BytesStorageMetadata for e in entries),
        "once_s": once,
        "twice_s": twice,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="the least of this many loads per figure")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/load_entries.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        print(
            "| parameters | non-tensor entries | load, entries read once (CPU s) | read twice (CPU s) | once / twice |"
        )
        print("|---|---|---|---|---|")
        rows = []
        for layers in LAYERS:
            row = measure(layers, args.repeat)
            rows.append(row)
            print(
                f"| {row['parameters']} | {row['entries']} | {row['once_s']:.3f} | {row['twice_s']:.3f} | "
                f"{row['once_s'] / row['twice_s']:.2f} |"
            )
        dist.destroy_process_group()
    results = {"config": results_config(args), "system": system_info(), "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
