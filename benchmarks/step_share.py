"""The optimizer's share of a training step, Muon against AdamW, from the cost model (no GPU here).

    python benchmarks/step_share.py

For Llama-3-8B and 70B under FSDP on 8, 64 and 1,024 H200s and 0.5M, 1M and 4M tokens per step:
the forward and backward take 6 N T / (G x 40% of 989 TFLOP/s) seconds (N parameters, T tokens, G
GPUs; 40% model-flops utilization, an assumption); AdamW reads parameter, gradient and both moments
and writes three of them in float32 (28 bytes per element) at the model's H200 memory bandwidth,
over the local shard of all N parameters, plus the host time of the 2 ops per parameter tensor that
torch's AdamW(foreach=True) issued on DTensors in ``bench_host.py`` (9 tensors per layer and 3 more,
at 5 us each); Muon's step is the cost model's prediction for the hidden
matrices (``predict(..., split=True)``: splits only where they pay; its host term counted from the
routes at 5 us per eager op, ``Hardware.h200().op_overhead``) plus AdamW on the rest (embeddings,
head, norms). Writes ``benchmarks/results/step_share.json``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from muon_dtensor.planning.costmodel import LLAMA3_8B, LLAMA3_70B, predict  # noqa: E402
from muon_dtensor.planning.hardware import Hardware  # noqa: E402

PEAK, MFU, ADAMW_BYTES = 989e12, 0.40, 28
# Parameter counts of Meta's Llama 3 releases (8.03 B and 70.6 B).
MODELS = {"llama3-8b": (LLAMA3_8B, 8.03e9), "llama3-70b": (LLAMA3_70B, 70.6e9)}
GPUS, TOKENS = (8, 64, 1024), (0.5e6, 1e6, 4e6)


def rows() -> list[dict[str, float | int | str]]:
    hw = Hardware.h200()
    out: list[dict[str, float | int | str]] = []
    for name, (shapes, total) in MODELS.items():
        hidden = sum(math.prod(s) for s in shapes)
        for gpus in GPUS:
            tensors = 9 * len(shapes) // 7 + 3  # q k v o gate up down, two norms; embedding, head, norm
            adamw = total / gpus * ADAMW_BYTES / hw.memory_bandwidth + 2 * tensors * hw.op_overhead
            muon = (
                predict(shapes, gpus, split=True).total
                + (total - hidden) / gpus * ADAMW_BYTES / hw.memory_bandwidth
            )
            for tokens in TOKENS:
                train = 6 * total * tokens / (gpus * PEAK * MFU)
                out.append(
                    {
                        "model": name,
                        "gpus": gpus,
                        "tokens": tokens,
                        "train_s": train,
                        "muon_ms": muon * 1e3,
                        "adamw_ms": adamw * 1e3,
                        "muon_share": muon / (train + muon),
                        "adamw_share": adamw / (train + adamw),
                    }
                )
    return out


def main() -> None:
    table = rows()
    print(
        "| model | GPUs | tokens/step | fwd+bwd s | Muon step ms | AdamW step ms | Muon share | AdamW share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(
            f"| {r['model']} | {r['gpus']:,} | {r['tokens'] / 1e6:g}M | {r['train_s']:.3f} | {r['muon_ms']:.1f} "
            f"| {r['adamw_ms']:.1f} | {100 * float(r['muon_share']):.2f}% | {100 * float(r['adamw_share']):.2f}% |"
        )
    out = ROOT / "benchmarks" / "results" / "step_share.json"
    assumptions = {"peak_flops": PEAK, "mfu": MFU, "adamw_bytes_per_element": ADAMW_BYTES}
    out.write_text(json.dumps({"assumptions": assumptions, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
