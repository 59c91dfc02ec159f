"""Which batches ``orthogonalize`` gets in a one-GPU step of Llama-shaped layers (the GPU check's
part c model), and the step's device time (CUDA events, 10 steps after 4) and top-level ops, with
the default ``max_round_bytes`` (4 MiB), 64 MiB and rounds unbounded, side by side in one run, with
each step's peak transient memory. Batches do not span exchange rounds, so a round's byte bound
also bounds a batch. Three models: part c's two Llama-3-8B layers (14 matrices of 4 shapes, 8 to
112 MiB each in bf16), eight layers of width 1,024 (56 matrices, 0.5 to 7 MiB) and Llama-3.2-1B's
16 layers (112 matrices, 2 to 32 MiB). On CPU it runs the check's dry-run shapes, untimed.

    PYTHONPATH=$PWD python3 benchmarks/gpu_round_batches.py [NAME]   # writes $OUT/NAME (gpu_round_batches.json)
"""

import collections
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.gpucheck import step as st  # noqa: E402
from benchmarks.gpucheck.common import DRY_DIMS, LLAMA_8B_DIMS, Dims  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.numerics import newton_schulz as ns  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODELS = {
    "llama3-8b x 2 layers": (LLAMA_8B_DIMS, 2),
    "width 1024 x 8 layers": (Dims(1024, 256, 3584), 8),
    "llama3.2-1b (width 2048 x 16 layers)": (Dims(2048, 512, 8192), 16),
}
SETTINGS = {
    "default": {},
    "max_round_bytes=64 MiB": {"max_round_bytes": 64 << 20},
    "max_round_bytes=2**40": {"max_round_bytes": 2**40},
}


def device_ms(opt: torch.optim.Optimizer, reps: int) -> list[float]:
    """Each step's CUDA-event time, sorted (nothing off CUDA)."""
    times = []
    for _ in range(reps if DEVICE.type == "cuda" else 0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def peak_transient_mib(opt: torch.optim.Optimizer) -> float | None:
    """What one step allocates above what was allocated before it, at its peak (None off CUDA)."""
    if DEVICE.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run(dims: Dims, layers: int, options: dict[str, Any]) -> dict[str, Any]:
    calls: list[tuple[int, tuple[int, ...]]] = []

    def logged(matrices: Any, config: Any) -> Any:
        calls.append((len(matrices), tuple(matrices[0].shape)))
        return ns.orthogonalize(matrices, config)

    model = st.make_model(layers, dims, DEVICE)
    st.seed_grads(model, 0)
    opt = Muon(split_params(model), lr=0.02, weight_decay=0.1, orthogonalize_fn=logged, **options)
    for _ in range(3):
        opt.step()
    calls.clear()
    opt.step()
    sizes = collections.Counter(calls)
    transient = peak_transient_mib(opt)
    times = device_ms(opt, 10)
    ops = st.count_ops(opt.step, DEVICE)
    return {
        "batches": {f"{n} x {s}": c for (n, s), c in sizes.items()},
        "device_ms": times,
        "ops": ops["ops"],
        "peak_transient_mib": transient,
        "mm": {k: v for k, v in ops["top_op_names"].items() if "mm" in k or k == "aten::mT"},
    }


def main() -> None:
    print("device", DEVICE, "env", os.environ.get(ns.BATCH_ENV), "batching", ns.batching(DEVICE.type))
    out: dict[str, Any] = {}
    for name, (dims, layers) in MODELS.items():
        for label, options in SETTINGS.items():
            row = run(dims if DEVICE.type == "cuda" else DRY_DIMS, layers, options)
            out[f"{name}, {label}"] = row
            print(name, label, json.dumps(row))
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()
    name = sys.argv[1] if len(sys.argv) > 1 else "gpu_round_batches.json"
    path = os.path.join(os.environ.get("OUT", "benchmarks/results"), name)
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    with open(path, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "runs": out}, f, indent=1)


if __name__ == "__main__":
    main()
