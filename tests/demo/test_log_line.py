"""The training log line (issue 51): the demo and examples/train.py printed the loss and little else.
Now rank 0 logs, every N steps, tokens per second, the global gradient norm (over every shard,
computed on logging steps only), each group's learning rate, the update RMS from ``Muon.metrics()``
and peak memory; the demo's progress bar prints the lines. The gradient norm is checked against the
norm of the whole gradients gathered on one rank, within float32 rounding of a sum of squares."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon_dtensor.demo.log import grad_norm, learning_rates, log_line
from muon_dtensor.demo.model import ModelConfig
from muon_dtensor.demo.progress import Progress
from muon_dtensor.demo.train import RunSpec, train
from tests.harness.ranks import run_ranks

LINE = re.compile(
    r"^step (\d+)/6 \| loss \d+\.\d{4} \| [\d,]+ tok/s \| grad norm ([\d.e+-]+) \| "
    r"lr muon 0\.02 adamw 0\.003 \| update rms \d\.\d\de-\d\d \| peak (RSS|mem) [\d,]+ MiB"
)


def _train(folder: str) -> list[str] | None:
    spec = RunSpec(
        "muon_dtensor", "fsdp", steps=6, micro_batches=2, micro_size=2, folder=folder,
        progress=str(Path(folder) / ".progress"), log_every=4, model=ModelConfig(),
    )  # fmt: skip
    out = train(spec)
    return None if out is None else out["log"]


@pytest.mark.slow  # the demo's training on 2 ranks: about 25 s on a loaded 2-core host
def test_demo_logs_every_n_steps_and_the_bar_prints_them(tmp_path: Path) -> None:
    stream = io.StringIO()
    with Progress("run", tmp_path / ".progress", stream=stream):
        lines, other = run_ranks(_train, 2, str(tmp_path), timeout=180)
    assert other is None  # rank 0 alone logs
    assert [int(LINE.match(line).group(1)) for line in lines] == [1, 4, 6], lines  # type: ignore[union-attr]
    assert all(float(LINE.match(line).group(2)) > 0 for line in lines)  # type: ignore[union-attr]
    printed = stream.getvalue().splitlines()
    assert printed[:3] == [f"  {line}" for line in lines] and "6/6 steps" in printed[3]


def _norms() -> tuple[float, float]:
    """This rank's ``grad_norm`` of FSDP2 gradients and the norm of the gathered whole gradients."""
    from muon_dtensor.demo.model import TinyLM
    from muon_dtensor.demo.parallel import build_mesh, demo_shape, shard_model

    torch.manual_seed(0)
    model = TinyLM(ModelConfig())
    shard_model(model, build_mesh(demo_shape("fsdp", dist.get_world_size())))
    torch.manual_seed(1 + dist.get_rank())  # other data per rank: the shards' norms differ
    model.loss(torch.randint(0, ModelConfig().vocab, (2, ModelConfig().seq + 1))).backward()
    whole: list[Any] = [
        p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()
    ]
    return grad_norm(model.parameters()), float(torch.nn.utils.get_total_norm(whole))


def test_grad_norm_is_global_over_shards() -> None:
    (mine, whole), (theirs, _) = run_ranks(_norms, 2, timeout=120)
    assert mine == theirs  # the same figure on every rank
    # float32 sums of a few thousand squares: relative error well under 1e-5
    assert abs(mine - whole) <= 1e-5 * whole, (mine, whole)


def test_line_without_metrics_and_numbered_groups() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    assert learning_rates(opt) == "group0 0.1 group1 0.2"
    line = log_line(3, 9, 1.5, 1234.5, 0.25, opt, "cpu")
    assert line.startswith(
        "step 3/9 | loss 1.5000 | 1,234 tok/s | grad norm 0.25 | lr group0 0.1 group1 0.2 | peak"
    )
