"""Train a small transformer with Lightning's ``ModelParallelStrategy`` (FSDP2) and ``muon_dtensor.Muon``.

The LightningModule shards itself in ``configure_model`` with ``fully_shard`` over the strategy's
``device_mesh["data_parallel"]`` and returns ``Muon(split_params(self))`` from
``configure_optimizers``: hidden matrices to Muon, embeddings, positions, norms and head to AdamW, in
one optimizer. Lightning saves the checkpoint through DCP (a folder with one shard file per rank) and
restores every rank's momentum shard on resume. On CPU Lightning picks gloo by itself;
``--accelerator gpu`` gives NCCL (not run by our tests, which are CPU only).

Run from the repository root with ``pip install -e . lightning``. Lightning starts the second
process itself (it re-runs this script with ``LOCAL_RANK`` set). Two epochs in one go, then the same
run cut in two (one epoch, a checkpoint, a resume in a fresh process)::

    python examples/lightning/train.py --devices 2 --epochs 2
    python examples/lightning/train.py --devices 2 --epochs 1 --save runs/lightning/ckpt
    python examples/lightning/train.py --devices 2 --epochs 2 --resume runs/lightning/ckpt

Each run prints rank 0's loss at every step and a digest of the final weights; the resumed run prints
the same last losses and digest as the uninterrupted one (``docs/lightning.md``). ``--full-checkpoint``
saves one file of full tensors (written by rank 0) instead of the DCP folder; it resumes the same way.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from muon_dtensor import Muon, split_params
from muon_dtensor.demo.data import corpus, tokens
from muon_dtensor.demo.model import ModelConfig, TinyLM

__all__ = ["LitLM", "dataset", "digest", "main", "make_muon", "make_trainer", "shard"]

CONFIG = ModelConfig(vocab=64, dim=32, layers=2, heads=2, seq=16)
ADAMW = {"lr": 3e-3, "weight_decay": 0.0}  # embeddings, positions, norms, head


class LitLM(L.LightningModule):
    """``TinyLM`` trained with one ``Muon``; sharded by ``configure_model``, as the strategy asks."""

    def __init__(self, cfg: ModelConfig = CONFIG, lr: float = 0.02) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.model = TinyLM(cfg)
        self.lr = lr
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.device_mesh is None:  # only ModelParallelStrategy makes one
            raise ValueError(
                f"LitLM shards itself over the strategy's device mesh, but the Trainer's strategy is "
                f"{type(self.trainer.strategy).__name__}; pass strategy=ModelParallelStrategy(...)"
            )
        shard(self.model, self.device_mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch[0])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Muon:
        return make_muon(self, self.lr)


def shard(model: TinyLM, mesh: DeviceMesh) -> TinyLM:
    """FSDP2 over the strategy's mesh ``(data_parallel, tensor_parallel)``: each block, then the root.
    Also Fabric's ``ModelParallelStrategy(parallelize_fn=shard)``."""
    dp = mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def make_muon(model: torch.nn.Module, lr: float = 0.02) -> Muon:
    """One optimizer: hidden matrices to Muon; embeddings, positions, norms and head to AdamW."""
    # "pos" is a 2-D parameter but not a hidden matrix: AdamW, like the embeddings.
    return Muon(split_params(model, adamw=("pos", "*.pos"), adamw_options=ADAMW), lr=lr, weight_decay=0.1)


def dataset(sequences: int = 16, cfg: ModelConfig = CONFIG) -> TensorDataset:
    """Fixed ``[sequences, seq + 1]`` token windows of the demo corpus (no download)."""
    data = tokens(corpus(20_000), cfg.vocab)
    starts = torch.arange(sequences) * (cfg.seq + 1)
    return TensorDataset(torch.stack([data[s : s + cfg.seq + 1] for s in starts.tolist()]))


def make_trainer(
    devices: int, epochs: int, *, sharded_checkpoint: bool = True, accelerator: str = "cpu", **kwargs: Any
) -> L.Trainer:
    """FSDP over every rank (``tensor_parallel_size=1``); no logger or progress bar, just the run.

    ``sharded_checkpoint``: a DCP folder with one file per rank (True), or one file that rank 0
    writes with the full weights and optimizer state (False).
    """
    strategy = ModelParallelStrategy(
        data_parallel_size=devices, tensor_parallel_size=1, save_distributed_checkpoint=sharded_checkpoint
    )
    options: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return L.Trainer(
        accelerator=accelerator, devices=devices, strategy=strategy, max_epochs=epochs, **options
    )


def digest(module: torch.nn.Module) -> str:
    """SHA-256 prefix of every full parameter's bytes: equal digests, bitwise equal weights."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (NCCL)")
    parser.add_argument("--epochs", type=int, default=2, help="train until this many epochs are done")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--save", help="where to save a checkpoint at the end (a DCP folder by default)")
    parser.add_argument("--resume", help="checkpoint (folder or file) to resume from")
    parser.add_argument(
        "--full-checkpoint", action="store_true", help="save one file of full tensors instead of DCP shards"
    )
    args = parser.parse_args(argv)
    module = LitLM()
    trainer = make_trainer(
        args.devices, args.epochs, sharded_checkpoint=not args.full_checkpoint, accelerator=args.accelerator
    )
    loader = DataLoader(dataset(), batch_size=args.batch_size)
    trainer.fit(module, loader, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    weights = digest(module)  # a collective: every rank takes part
    if trainer.is_global_zero:
        first = trainer.global_step - len(module.losses) + 1
        for step, loss in enumerate(module.losses, start=first):
            print(f"step {step} loss {loss:.4f}")
        print(f"global_step {trainer.global_step} weights {weights}")


if __name__ == "__main__":
    main()
