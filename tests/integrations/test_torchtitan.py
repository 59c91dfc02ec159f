"""torchtitan 0.3.0 selects ``muon_dtensor.Muon`` through ``examples/torchtitan/muon_optimizer.py``.

torchtitan's trainer cannot run here: it calls ``torch.cuda.set_device`` when no accelerator is
found (docs/torchtitan.md; its Llama 3 and parallelisms: test_torchtitan_llama.py). These tests drive, on CPU and gloo, the
torchtitan parts the trainer uses around the optimizer: the container built from its config as the
trainer builds it (``config.optimizer.build(model_parts=...)``), its ``LambdaLR`` schedulers (which
add ``initial_lr`` to every group), its ``CheckpointManager`` saving and loading through
``dcp.save({"optimizer": container, "lr_scheduler": ..., **model_state})``, and its CLI parser.

The container must not change the maths: a 2-rank FSDP2 run through it equals one process stepping
the same gradients, bit for bit; a checkpoint saved at step 3 restores every parameter, momentum
buffer and AdamW moment bit for bit into a fresh model and container, on 2 ranks and on 1, and the
resumed steps 4 and 5 equal the uninterrupted ones (the learning-rate schedule comes back too).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from muon_dtensor import Muon
from tests.harness.ranks import run_ranks
from tests.helpers.models import Net, build, distribute_like, full, model_grads

needs_titan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"
)
MATRICES = r"^layers\.\d+\.weight$"  # tests.helpers.models.Net's hidden matrices
SAVE_AT, STEPS, GRAD_SEED = 3, 5, 500
Snapshot = dict[str, torch.Tensor]  # FQN (and ":state key") -> full tensor


class TrainState:
    """The trainer's own Stateful entry (``states={"train_state": trainer}``): here, the step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def titan_stack(model: nn.Module, variant: str) -> tuple[Any, Any]:
    """The container and schedulers, built from configs as torchtitan's ``Trainer.__init__`` does."""
    from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig  # type: ignore[import-untyped]

    from examples.torchtitan.muon_optimizer import MuonOptimizersContainer, muon_optimizer_config

    config = muon_optimizer_config(lr=0.02, adamw_lr=3e-3, muon_pattern=MATRICES)
    if variant == "muon+torch_adamw":  # torchtitan's own AdamW for the rest: two optimizers
        config = MuonOptimizersContainer.Config(
            implementation="foreach",
            param_groups=[
                config.param_groups[0],
                ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-3}),
            ],
        )
    optimizers = config.build(model_parts=[model])
    schedule = LRSchedulersContainer.Config(warmup_steps=4, decay_ratio=0.5, decay_type="cosine")
    return optimizers, schedule.build(optimizers=optimizers, training_steps=8)


def checkpointer(folder: str, model: nn.Module, optimizers: Any, schedulers: Any) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager  # type: ignore[import-untyped]

    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=SAVE_AT, keep_latest_k=0)
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": TrainState()},
        sd_adapter=None,
        base_folder=folder,
    )


def train(model: nn.Module, optimizers: Any, schedulers: Any, steps: range, ckpt: Any = None) -> None:
    """The trainer's order: gradients, ``optimizers.step()``, ``lr_schedulers.step()``, save."""
    grads = model_grads(model, GRAD_SEED)
    for step in steps:
        for p, g in zip(model.parameters(), grads(step), strict=True):
            p.grad = distribute_like(p, g)
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        if ckpt is not None:
            ckpt.states["train_state"].step = step + 1
            ckpt.save(curr_step=step + 1)


def snapshot(optimizers: Any) -> Snapshot:
    """Every parameter and state entry as a full tensor, keyed by FQN (a collective on DTensors)."""
    out: Snapshot = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p, name in zip(group["params"], group["param_names"], strict=True):
                out[name] = full(p.detach()).clone()
                for key, value in opt.state[p].items():
                    out[f"{name}:{key}"] = full(value).clone()
    return dict(sorted(out.items()))


def differences(a: Snapshot, b: Snapshot) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys: {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def group_keys(optimizers: Any) -> list[list[str]]:
    return [sorted(g) for opt in optimizers for g in opt.param_groups]


def flat_state(optimizers: Any) -> dict[str, str]:
    """What the checkpointer hands DCP for the optimizer: key -> value type (and placements)."""
    out = {}
    for key, value in optimizers.state_dict().items():
        extra = f" {tuple(value.placements)}" if isinstance(value, DTensor) else ""
        out[key] = type(value).__name__ + extra
    return out


def save_and_resume(folder: str, variant: str) -> dict[str, Any]:
    """Train 3 steps through torchtitan's container, saving at step 3; load into a fresh model and
    container (other initial weights) through a fresh CheckpointManager; take steps 4 and 5 on both."""
    world = torch.distributed.get_world_size()
    model = build((world,))
    optimizers, schedulers = titan_stack(model, variant)
    ckpt = checkpointer(folder, model, optimizers, schedulers)
    train(model, optimizers, schedulers, range(SAVE_AT), ckpt)
    saved, flat, keys = snapshot(optimizers), flat_state(optimizers), group_keys(optimizers)
    train(model, optimizers, schedulers, range(SAVE_AT, STEPS))
    twin = snapshot(optimizers)
    out = resume(folder, variant, saved, twin)
    out.update(flat=flat, group_keys=keys, optimizers=[type(o).__name__ for o in optimizers])
    if variant == "muon":  # the same container on the unsharded model, in this process
        ref = build(None)
        ref_opts, ref_scheds = titan_stack(ref, variant)
        train(ref, ref_opts, ref_scheds, range(SAVE_AT))
        out["vs_one_process"] = differences(saved, snapshot(ref_opts))
    ckpt.close()
    if torch.distributed.get_rank() == 0:
        torch.save({"saved": saved, "twin": twin}, Path(folder, "expected.pt"))
    return out


def resume(folder: str, variant: str, saved: Snapshot, twin: Snapshot) -> dict[str, Any]:
    """A fresh model (other initial weights), container, schedulers and CheckpointManager on this
    world size load the newest checkpoint and take the steps after it."""
    fresh = build((torch.distributed.get_world_size(),), seed=1)
    optimizers, schedulers = titan_stack(fresh, variant)
    ckpt = checkpointer(folder, fresh, optimizers, schedulers)
    out = {"loaded": ckpt.load(), "restored": differences(saved, snapshot(optimizers))}
    train(fresh, optimizers, schedulers, range(SAVE_AT, STEPS))
    out.update(
        resumed=differences(twin, snapshot(optimizers)),
        train_state=ckpt.states["train_state"].step,
        last_epoch=schedulers.schedulers[0].last_epoch,
        entries=len(saved),
    )
    ckpt.close()
    return out


def resume_elsewhere(folder: str, variant: str) -> dict[str, Any]:
    expected = torch.load(Path(folder, "expected.pt"))
    return resume(folder, variant, expected["saved"], expected["twin"])


def check_resumed(r: dict[str, Any], where: str) -> None:
    assert r["loaded"] is True, where
    assert r["restored"] == [], f"{where}: not restored bit for bit: {r['restored']}"
    assert r["resumed"] == [], f"{where}: resumed step differs from the uninterrupted one: {r['resumed']}"
    assert (r["train_state"], r["last_epoch"]) == (SAVE_AT, STEPS), where


@needs_titan
@pytest.mark.parametrize("variant", ["muon", "muon+torch_adamw"])
@pytest.mark.integration
def test_titan_container_checkpoint_round_trip(tmp_path: Path, variant: str) -> None:
    results = run_ranks(save_and_resume, 2, str(tmp_path), variant, timeout=180)
    for rank, r in enumerate(results):
        check_resumed(r, f"rank {rank} of 2")
        assert r.get("vs_one_process", []) == [], f"rank {rank}: sharded != one process"
    r = results[0]
    # 5 matrices with momentum; 7 AdamW parameters with step, exp_avg, exp_avg_sq
    assert r["entries"] == 5 * 2 + 7 * 4, r["entries"]
    assert r["optimizers"] == (["Muon"] if variant == "muon" else ["Muon", "AdamW"])
    for keys in r["group_keys"]:  # torchtitan's keys reached the optimizer's groups
        assert {"param_names", "fused", "foreach", "initial_lr"} <= set(keys), keys
    # the flat, FQN-keyed state torchtitan's checkpointer saves: momentum as sharded DTensors
    assert r["flat"]["state.layers.0.weight.momentum_buffer"] == "DTensor (Shard(dim=0),)"
    assert r["flat"]["param_groups.layers.0.weight.initial_lr"] == "float"
    shards = sorted(f.name for f in (tmp_path / "checkpoint" / f"step-{SAVE_AT}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], shards  # each rank wrote its own
    if variant == "muon":  # the same checkpoint, loaded on one rank
        check_resumed(run_ranks(resume_elsewhere, 1, str(tmp_path), variant, timeout=120)[0], "1 rank")


def _groups(net: Net, extra: dict[str, Any]) -> list[dict[str, Any]]:
    named = list(net.named_parameters())
    matrices = [(n, p) for n, p in named if n.startswith("layers.") and p.ndim == 2]
    rest = [(n, p) for n, p in named if (n, p) not in matrices]
    return [
        {"params": [p for _, p in matrices], "param_names": [n for n, _ in matrices], **extra},
        {"params": [p for _, p in rest], "param_names": [n for n, _ in rest], "algorithm": "adamw", **extra},
    ]


def test_torch_optim_group_keys_are_accepted_and_change_nothing() -> None:
    """The keys torchtitan and LambdaLR put in every group step exactly like groups without them."""
    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    flags = {"fused": True, "foreach": False, "capturable": False, "differentiable": False}
    extra = {**flags, "maximize": False, "initial_lr": 0.05, "lr": 0.02}  # LambdaLR: lr = factor * initial_lr
    opts = [Muon(_groups(nets[0], extra)), Muon(_groups(nets[1], {"lr": 0.02}))]
    grads = model_grads(nets[0], GRAD_SEED)
    for step in range(3):
        for net, opt in zip(nets, opts):
            for p, g in zip(net.parameters(), grads(step)):
                p.grad = g.clone()
            opt.step()
    for (name, p), q in zip(nets[0].named_parameters(), nets[1].parameters()):
        assert torch.equal(p, q), name
        assert all(torch.equal(v, opts[1].state[q][k]) for k, v in opts[0].state[p].items()), name


@pytest.mark.parametrize("key", ["differentiable", "maximize"])
def test_flags_that_would_change_the_step_are_refused(key: str) -> None:
    groups = _groups(Net(), {})
    groups[1][key] = True
    with pytest.raises(ValueError, match=f"param group 1 sets {key}=True, which muon_dtensor.Muon"):
        Muon(groups)


@needs_titan
@pytest.mark.integration
def test_cli_parsing_keeps_the_muon_container() -> None:
    """torchtitan's ConfigManager parses the CLI with ``tyro.cli(type(config), default=config)``;
    the Muon container's config must survive it, or the trainer would build plain AdamW."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.manager import ConfigManager, custom_registry  # type: ignore[import-untyped]

    from examples.torchtitan.muon_optimizer import MuonOptimizersContainer, muon_optimizer_config

    # Trainer.Config's optimizer field, with its declared type (a class, not a string annotation)
    optimizer = ("optimizer", OptimizersContainer.Config, field(default_factory=OptimizersContainer.Config))
    trainer_config = make_dataclass("TrainerConfig", [optimizer], kw_only=True, slots=True)
    ConfigManager()  # registers torchtitan's tyro rules
    default = trainer_config(optimizer=muon_optimizer_config(muon_pattern=MATRICES))
    args = ["--optimizer.implementation", "for-loop"]
    config = tyro.cli(trainer_config, args=args, default=default, registry=custom_registry)
    built = config.optimizer.build(model_parts=[Net()])
    assert isinstance(built, MuonOptimizersContainer)
    assert [type(o) for o in built] == [Muon]
    assert [g["fused"] for g in built.optimizers[0].param_groups] == [False, False]
