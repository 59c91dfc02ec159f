"""Which batches ``orthogonalize`` gets in the GPU check's one-GPU step (part c: two Llama-3-8B
layers, 14 matrices of 4 shapes), and the step's device time (CUDA events, 10 steps after 4) and
top-level ops, with the default ``max_round_bytes`` (4 MiB) and with rounds unbounded, side by
side in one run. Batches do not span exchange rounds, so a round's byte bound also bounds a batch.
On CPU it runs the check's dry-run shapes (the step's timing is then skipped).

    PYTHONPATH=$PWD python3 benchmarks/gpu_round_batches.py   # writes $OUT/gpu_round_batches.json
"""

import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from benchmarks.gpucheck import step as st  # noqa: E402
from benchmarks.gpucheck.common import DRY_DIMS, LLAMA_8B_DIMS  # noqa: E402
from muon_dtensor import Muon, split_params  # noqa: E402
from muon_dtensor.numerics import newton_schulz as ns  # noqa: E402

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dims = LLAMA_8B_DIMS if device.type == "cuda" else DRY_DIMS
reps = 10 if device.type == "cuda" else 2
print("device", device, "env", os.environ.get(ns.BATCH_ENV), "batching", ns.batching(device.type))
out = {}
for label, options in (("default", {}), ("max_round_bytes=2**40", {"max_round_bytes": 2**40})):
    calls = []

    def logged(matrices, config, calls=calls):
        calls.append((len(matrices), tuple(matrices[0].shape)))
        return ns.orthogonalize(matrices, config)

    model = st.make_model(2, dims, device)
    st.seed_grads(model, 0)
    opt = Muon(split_params(model), lr=0.02, weight_decay=0.1, orthogonalize_fn=logged, **options)
    for _ in range(3):
        opt.step()
    calls.clear()
    opt.step()
    sizes = collections.Counter(calls)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            opt.step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            opt.step()
    r = st.count_ops(opt.step, device)
    mm = {k: v for k, v in r["top_op_names"].items() if "mm" in k or k == "aten::mT"}
    out[label] = {
        "batches": {f"{n} x {s}": c for (n, s), c in sizes.items()},
        "device_ms": sorted(times),
        "ops": r["ops"],
        "mm": mm,
    }
    print(label, json.dumps(out[label]))
    del opt, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
path = os.path.join(os.environ.get("OUT", "benchmarks/results"), "gpu_round_batches.json")
with open(path, "w") as f:
    json.dump(
        {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "runs": out,
        },
        f,
        indent=1,
    )
