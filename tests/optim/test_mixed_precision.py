"""FSDP2 with a ``MixedPrecisionPolicy`` (bf16 compute and all-gather, fp32 reduce: the torchtitan and
accelerate default). The sharded parameters and the optimizer state stay fp32; the step, the
checkpoint and a resume on the same layout must be exact, and training must track the fp32 run."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from muon_dtensor import Muon, split_params
from muon_dtensor.checkpoint import load_checkpoint, save_checkpoint
from tests.harness import background
from tests.helpers.models import Net, full_state

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SAVED, TOTAL = 2, 5


def _build(mixed: bool) -> tuple[nn.Module, Muon]:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = POLICY if mixed else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, Muon(split_params(model), lr=0.02)


def _train(model: nn.Module, opt: Muon, steps: range) -> list[float]:
    losses = []
    for step in steps:
        # learnable: each sequence counts up by 1 or 2 from a random start, mod 11
        gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        starts, strides = (
            torch.randint(0, 11, (8, 1), generator=gen),
            torch.randint(1, 3, (8, 1), generator=gen),
        )
        tokens = (starts + strides * torch.arange(8)) % 11
        opt.zero_grad()
        logits = model(tokens[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def mixed_precision_run(root: str) -> dict[str, Any]:
    model, opt = _build(mixed=True)
    losses = _train(model, opt, range(TOTAL))
    straight = full_state(model, opt)
    dtypes = {str(v.dtype) for k, v in straight.items() if ":" not in k or "momentum" in k}
    first, first_opt = _build(mixed=True)
    _train(first, first_opt, range(SAVED))
    save_checkpoint(root, SAVED, first, first_opt)
    resumed, resumed_opt = _build(mixed=True)
    load_checkpoint(root, resumed, resumed_opt)
    _train(resumed, resumed_opt, range(SAVED, TOTAL))
    after = full_state(resumed, resumed_opt)
    ref, ref_opt = _build(mixed=False)
    ref_losses = _train(ref, ref_opt, range(TOTAL))
    differ = [k for k, v in straight.items() if not torch.equal(v, after[k])]
    return {"losses": losses, "ref_losses": ref_losses, "differ": differ, "dtypes": sorted(dtypes)}


def test_mixed_precision_trains_checkpoints_and_resumes_exactly(
    mixed_precision_on_2_ranks: list[Any],
) -> None:
    for rank, r in enumerate(mixed_precision_on_2_ranks):
        assert r["differ"] == [], f"rank {rank}: resumed run differs at {r['differ']}"
        assert r["dtypes"] == ["torch.float32"], r["dtypes"]  # fp32 shards and momentum
        assert r["losses"][-1] < r["losses"][0], r["losses"]
        # bf16 compute against fp32 compute: a few bf16 roundings of the loss
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < 0.05, r


# The ranks' runs, a background job on a pool of its own (tests/harness/background.py, ``apart``).
mixed_precision_on_2_ranks = background.apart(
    "mixed_precision_on_2_ranks", mixed_precision_run, 2, timeout=180, in_folder=True
)
