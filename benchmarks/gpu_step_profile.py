"""Where a one-GPU optimizer step's device time goes: ``gpu_step_share.py``'s models and arms, one
steady step each (after 3) under ``torch.profiler``, the kernels grouped by name and summed.

    PYTHONPATH=$PWD python3 benchmarks/gpu_step_profile.py   # tables to $OUT/gpu_step_profile.txt
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from benchmarks.gpu_step_share import ARMS, DRY, FULL, build  # noqa: E402
from muon_dtensor.demo.model import ModelConfig, TinyLM  # noqa: E402


def profile_arm(arm: str, cfg: ModelConfig, batch: int, device: torch.device) -> str:
    torch.manual_seed(0)
    with device:
        model = TinyLM(cfg)
    opt = build(arm, model, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1)).to(device)
    for i in range(4):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model.loss(tokens).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i < 3:
            opt.step()
            opt.zero_grad(set_to_none=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60)


def main() -> None:
    dry = not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    out = Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_step_profile.txt"
    texts = []
    for name, (cfg, batches) in (DRY if dry else FULL).items():
        for arm in ARMS[:3]:
            texts.append(f"## {name}, {batches[0] * cfg.seq} tokens, {arm}\n")
            texts.append(profile_arm(arm, cfg, batches[0], device))
            out.write_text("\n".join(texts))
            print(texts[-2].strip(), "done", flush=True)


if __name__ == "__main__":
    main()
