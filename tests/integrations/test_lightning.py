"""Lightning's ``ModelParallelStrategy`` (FSDP2) on 2 CPU ranks with ``muon_dtensor.Muon`` returned by
``configure_optimizers``, through ``examples/lightning/train.py``'s LightningModule and Trainer.

Lightning saves a ``ModelParallelStrategy`` checkpoint through DCP and restores the optimizer with
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``. A resume is exact only if every rank's
momentum shard comes back: the run cut after epoch 1 and resumed in a fresh Trainer and module must
restore every momentum buffer bitwise and then be its uninterrupted twin, loss for loss and bit for bit.

The Trainer runs inside the pooled ranks (tests/harness/ranks.py): with ``LOCAL_RANK`` set, Lightning's
default cluster environment takes the processes as launched by someone else (as under torchrun) and
uses the process group that is already there, so no process is started and no port is needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tests.harness.ranks import run_ranks

# Lightning is imported where a test runs it, not at collection: the import costs about 3 CPU s, and
# the fast tier runs none of these tests
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None, reason="needs lightning (the lightning extra)"
    ),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning" / "train.py"


def _load_example() -> Any:
    """The example script as a module (``examples`` is not a package)."""
    name = "muon_dtensor_lightning_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.contextmanager
def _launched_externally() -> Iterator[None]:
    """``LOCAL_RANK`` tells Lightning the processes exist; restored after, the pool is shared."""
    saved = {k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE")}
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _full_state(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer state entry as a full tensor, keyed ``<parameter FQN>:<state key>``."""
    opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps ours
    out = {}
    for name, p in module.named_parameters():
        for key, value in opt.state[p].items():
            out[f"{name}:{key}"] = value.full_tensor() if isinstance(value, DTensor) else value.clone()
    return out


def _record_restored() -> Any:
    """A callback that keeps the optimizer state as the resumed run starts, after Lightning loaded
    the checkpoint (in ``.state``)."""
    from lightning.pytorch import Callback

    class RecordRestored(Callback):
        def __init__(self) -> None:
            self.state: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.state = _full_state(pl_module, trainer.optimizers[0])

    return RecordRestored()


def _fit(
    folder: Path, epochs: int, ckpt: Path | None = None, resume: bool = False, sharded: bool = True
) -> dict[str, Any]:
    """One Trainer run of the example's module; saves to ``ckpt`` at the end, or resumes from it."""
    example = _load_example()
    module, recorder = example.LitLM(), _record_restored()
    trainer = example.make_trainer(
        2, epochs, sharded_checkpoint=sharded, callbacks=[recorder], default_root_dir=str(folder)
    )
    loader = torch.utils.data.DataLoader(example.dataset(), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers and its pytree notice
        trainer.fit(module, loader, ckpt_path=str(ckpt) if resume else None)
    if ckpt is not None and not resume:
        trainer.save_checkpoint(ckpt)
    opt = trainer.optimizers[0]
    return {
        "losses": module.losses,
        "step": trainer.global_step,
        "digest": example.digest(module),
        "state": _full_state(module, opt),
        "restored": recorder.state,
        "not_sharded": _not_sharded(module, opt),
    }


def _not_sharded(module: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """State entries that are not ``Shard(0)`` DTensors like their parameter: FSDP2 over both ranks."""
    bad = []
    for name, p in module.named_parameters():
        for key, value in opt.state[p].items():
            if value.ndim and not _sharded_like(value, p):
                bad.append(f"{name}:{key}")
    return bad


def _sharded_like(value: torch.Tensor, p: torch.Tensor) -> bool:
    if not (isinstance(value, DTensor) and isinstance(p, DTensor)):
        return False
    return value.placements == p.placements == (Shard(0),)


def _cut_and_resume(folder: Path, whole: dict[str, Any], sharded: bool) -> dict[str, Any]:
    """Epoch 1 and a checkpoint, then a fresh module and Trainer resume it for epoch 2."""
    ckpt = folder / ("ckpt" if sharded else "full.ckpt")
    cut = _fit(folder, 1, ckpt, sharded=sharded)
    resumed = _fit(folder, 2, ckpt, resume=True, sharded=sharded)
    saved = cut["state"]
    momentum = [k for k in saved if k.endswith(":momentum_buffer")]
    files = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else [ckpt.name]
    return {
        "cut": {k: cut[k] for k in ("losses", "step", "digest")},
        "resumed": {k: resumed[k] for k in ("losses", "step", "digest")},
        "momentum": len(momentum),
        "momentum_nonzero": sum(bool(saved[k].any()) for k in momentum),
        "not_restored": [
            k for k in saved if not torch.equal(saved[k], resumed["restored"].get(k, torch.empty(0)))
        ],
        "not_twin": [k for k, v in whole["state"].items() if not torch.equal(v, resumed["state"][k])],
        "not_sharded": cut["not_sharded"] + resumed["not_sharded"],
        "files": files,
    }


def cut_and_whole(folder: str) -> dict[str, Any]:
    """One rank: the uninterrupted 2-epoch twin, then the run cut in two with each checkpoint kind."""
    root = Path(folder)
    with _launched_externally():
        whole = _fit(root / "whole", 2)
        runs = {kind: _cut_and_resume(root / kind, whole, kind == "dcp") for kind in ("dcp", "full")}
    return {"whole": {k: whole[k] for k in ("losses", "step", "digest")}, **runs}


@pytest.mark.slow
def test_lightning_model_parallel_resume_is_its_twin(tmp_path: Path) -> None:
    results = run_ranks(cut_and_whole, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        whole = r["whole"]
        assert whole["step"] == 8 and whole["losses"][-1] < whole["losses"][0], whole
        for kind in ("dcp", "full"):
            run, where = r[kind], f"rank {rank}, {kind} checkpoint"
            assert run["momentum"] == 12 == run["momentum_nonzero"], (where, run)
            assert run["not_restored"] == [], f"{where}: state not restored bitwise: {run['not_restored']}"
            assert run["not_sharded"] == [], f"{where}: state not laid out like its Shard(0) parameter"
            assert (run["cut"]["step"], run["resumed"]["step"]) == (4, 8), (where, run)
            # the cut run is the twin's first epoch, and the resumed one its second, to the bit
            assert run["cut"]["losses"] == whole["losses"][:4], (where, run, whole)
            assert run["resumed"]["losses"] == whole["losses"][4:], (where, run, whole)
            assert run["resumed"]["digest"] == whole["digest"] != run["cut"]["digest"], (where, run, whole)
            assert run["not_twin"] == [], f"{where}: optimizer state differs from the twin: {run['not_twin']}"
    dcp_files, full_files = results[0]["dcp"]["files"], results[0]["full"]["files"]
    assert ".metadata" in dcp_files and sum(f.endswith(".distcp") for f in dcp_files) == 2, dcp_files
    assert full_files == ["full.ckpt"], full_files


def _fabric_steps(fabric: Any, model: Any, opt: Any, steps: range) -> list[float]:
    """Each rank trains on its half of a global batch of 4 sequences per step."""
    data, losses = _load_example().dataset().tensors[0], []
    for step in steps:
        batch = data[(4 * step + 2 * fabric.global_rank) % 16 :][:2]
        loss = model.module.loss(batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fabric_setup(load: Path | None = None) -> tuple[Any, Any, Any]:
    """A fresh Fabric, model and Muon (built on the sharded parameters); loads ``load`` if given."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    example = _load_example()
    strategy = ModelParallelStrategy(example.shard, data_parallel_size=2, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(example.TinyLM(example.CONFIG))
    opt = fabric.setup_optimizers(example.make_muon(model.module))
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": opt})
    return fabric, model, opt


def fabric_cut_and_whole(folder: str) -> dict[str, Any]:
    """One rank: 4 steps, ``fabric.save``, 4 more; then a fresh Fabric loads and does the same 4."""
    ckpt, digest = Path(folder) / "fabric_ckpt", _load_example().digest
    with _launched_externally(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric, model, opt = _fabric_setup()
        first = _fabric_steps(fabric, model, opt, range(4))
        saved = _full_state(model.module, opt)
        fabric.save(ckpt, {"model": model, "optimizer": opt})
        twin = _fabric_steps(fabric, model, opt, range(4, 8))
        fabric, model2, opt2 = _fabric_setup(load=ckpt)
        restored = _full_state(model2.module, opt2)
        resumed = _fabric_steps(fabric, model2, opt2, range(4, 8))
    twin_state, resumed_state = _full_state(model.module, opt), _full_state(model2.module, opt2)
    return {
        "losses": (first, twin, resumed),
        "digests": (digest(model.module), digest(model2.module)),
        "momentum": sum(k.endswith(":momentum_buffer") and bool(v.any()) for k, v in saved.items()),
        "not_restored": [k for k, v in saved.items() if not torch.equal(v, restored[k])],
        "not_twin": [k for k, v in twin_state.items() if not torch.equal(v, resumed_state[k])],
    }


@pytest.mark.slow
def test_fabric_model_parallel_resume_is_its_twin(tmp_path: Path) -> None:
    for rank, r in enumerate(run_ranks(fabric_cut_and_whole, 2, str(tmp_path), timeout=180)):
        first, twin, resumed = r["losses"]
        assert r["momentum"] == 12, (rank, r)
        assert r["not_restored"] == [] and r["not_twin"] == [], (rank, r)
        assert resumed == twin and twin[-1] < first[0], (rank, r)
        assert r["digests"][0] == r["digests"][1], (rank, r)


def example_commands(folder: str) -> list[str]:
    """One rank: the docstring's three commands through ``main``; rank 0's printout of each."""
    ckpt, out = str(Path(folder) / "ckpt"), []
    commands = [["--epochs", "2"], ["--epochs", "1", "--save", ckpt], ["--epochs", "2", "--resume", ckpt]]
    with _launched_externally(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for args in commands:
            with contextlib.redirect_stdout(io.StringIO()) as text:
                _load_example().main(["--devices", "2", *args])
            out.append(text.getvalue())
    return out


@pytest.mark.slow
def test_example_commands_resume_to_the_same_weights(tmp_path: Path) -> None:
    whole, cut, resumed = run_ranks(example_commands, 2, str(tmp_path), timeout=180)[0]
    assert whole.splitlines()[-1].startswith("global_step 8 weights "), whole
    assert cut.splitlines()[-1].startswith("global_step 4 weights "), cut
    # the resumed run prints the twin's steps 5 to 8 and its final weights
    assert resumed.splitlines() == whole.splitlines()[4:], (whole, resumed)
    assert cut.splitlines()[:4] == whole.splitlines()[:4], (whole, cut)
