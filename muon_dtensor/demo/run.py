"""``python -m muon_dtensor demo``: FSDP2 training with Muon on N ranks against one process.

Spawns ``--world-size`` ranks (gloo on CPU, NCCL when GPUs are present), trains a small transformer
language model on a generated corpus with one muon_dtensor optimizer (Muon for hidden matrices, AdamW
for the rest), runs the same training in one process, and prints both loss curves side by side.
"""

from __future__ import annotations

import argparse
import sys
import time

from muon_dtensor.launch import run_ranks

from .train import train_sharded, train_single


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muon_dtensor demo", description=__doc__)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--layout", choices=["fsdp", "hsdp"], default="fsdp")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    print(f"training on {args.world_size} ranks ({args.layout}) and in one process, {args.steps} steps")
    sharded = run_ranks(train_sharded, args.world_size, args.steps, args.layout, timeout=900)[0]
    single = train_single(args.steps)
    print(f"\n| step | loss, {args.world_size} ranks | loss, 1 process |\n|---:|---:|---:|")
    for i, (a, b) in enumerate(zip(sharded["losses"], single["losses"])):
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"| {i} | {a:.4f} | {b:.4f} |")
    gap = max(
        float((sharded["params"][n] - p).abs().max()) for n, p in single["params"].items()
    )
    learned = sharded["losses"][-1] < 0.7 * sharded["losses"][0]
    tracks = abs(sharded["losses"][-1] - single["losses"][-1]) < 0.05
    print(f"\nlargest parameter difference: {gap:.2e}; {time.perf_counter() - start:.0f} s")
    ok = learned and tracks
    print(f"verdict: {'PASS' if ok else 'FAIL'}: sharded run {'tracks' if tracks else 'does NOT track'}"
          f" the one-process run and the loss {'fell' if learned else 'did not fall enough'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
