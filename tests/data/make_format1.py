"""Writes tests/data/format1: a checkpoint of muon_dtensor 0.2.0's save_checkpoint (param groups by
index), and expected.safetensors with every parameter and state entry it holds."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, split_params
from tests.helpers.models import Net

out = Path(sys.argv[1])
torch.manual_seed(0)
model = Net()
opt = Muon(split_params(model), lr=0.02)
for step in range(2):
    opt.zero_grad()
    model(torch.arange(6).reshape(2, 3) + step).square().mean().backward()
    opt.step()
ckpt.save_checkpoint(out, 2, model, opt, extra={"data_position": 12})
expected = {n: p.detach().clone() for n, p in model.named_parameters()}
for n, p in model.named_parameters():
    expected.update({f"{n}:{k}": v.clone() for k, v in opt.state[p].items()})
save_file(expected, str(out / "expected.safetensors"))
print(ckpt.__file__, sorted(expected)[:4])
