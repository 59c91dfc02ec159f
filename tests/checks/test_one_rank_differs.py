"""One rank differs: every public call that communicates, run with one argument changed on one rank
only, on 2 and 3 gloo ranks. Every rank must raise the same error within a few seconds, and no weight,
optimizer state or file may change.

The cases come from one table, ``ROWS``: (call, argument, the value on every other rank, the value on
the last rank). A new public call that communicates is a new row (and an entry in ``CALLS``). This is
what holds the library to its one agreement primitive (``muon_dtensor/checks/together.py``): before
it, ``qk_clip_all_`` with no layers on one rank, layers in another order across two meshes, or one
layer passed as a DTensor on one rank and as a plain tensor on the other left ranks waiting forever,
a save with another step or ``extra`` on one rank wrote a checkpoint under rank 0's step, and a step
with a parameter on a mesh the other ranks do not step on waited forever in that mesh's check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import muon_dtensor.checkpoint as ckpt
from muon_dtensor import Muon, qk_clip_, qk_clip_all_, split_params
from muon_dtensor.integrations.clipping import clip_grad_norm_stages_
from muon_dtensor.sharding.plan import grid
from tests.harness import background
from tests.helpers.models import build

BOUND_S = 10.0  # seconds a case may take on any rank: a rank left waiting would take the call's timeout
DEFAULT_COEFFICIENTS = (3.4445, -4.775, 2.0315)

ROWS: list[tuple[str, str, Any, Any]] = [
    # Muon.step: a group setting changed on one rank after construction, the parameters, the gradients
    ("step", "lr", 0.02, 0.03),
    ("step", "momentum", 0.95, 0.9),
    ("step", "weight_decay", 0.1, 0.0),
    ("step", "nesterov", True, False),
    ("step", "ns_steps", 5, 4),
    ("step", "ns_coefficients", DEFAULT_COEFFICIENTS, (3.0, -3.2, 1.2)),
    ("step", "eps", 1e-7, 1e-6),
    ("step", "adjust_lr_fn", None, "match_rms_adamw"),
    ("step", "ns_dtype", "bfloat16", "float32"),
    ("step", "momentum_dtype", None, torch.bfloat16),
    ("step", "mode", "owner", "gather"),
    ("step", "max_round_bytes", 4 << 20, 1 << 10),
    ("step", "ns_split", "off", 2),
    ("step", "owners", "auto", "mesh"),
    ("step", "capturable", False, True),
    ("step", "capturable (at construction)", False, True),
    ("step", "params (order)", "as built", "first two swapped"),
    ("step", "params (contents)", "every matrix", "the last one left out"),
    ("step", "gradient", "present", "missing"),
    ("step", "params (meshes)", "the model's mesh", "a second mesh too"),
    # the check's sum forced through its butterfly, after a group that only some ranks joined (issue 49)
    ("step", "lr (butterfly, a subset group made first)", 0.02, 0.03),
    # qk_clip_: the arguments, the weights' kind, this rank's max logits
    ("qk_clip_", "head_dim", 4, 2),
    ("qk_clip_", "threshold", 100.0, 50.0),
    ("qk_clip_", "alpha", 0.5, 0.25),
    ("qk_clip_", "q_weight (type)", "DTensor", "plain tensor"),
    ("qk_clip_", "max_logits", "float", "int"),
    # qk_clip_all_: the layers (contents, order, container, kind), the arguments
    ("qk_clip_all_", "layers (contents)", "two layers", "none"),
    ("qk_clip_all_", "layers (order)", "a, b", "b, a"),
    ("qk_clip_all_", "layers (container)", "dict", "list"),
    ("qk_clip_all_", "layers (order, in a list)", "list: a, b", "list: b, a"),
    ("qk_clip_all_", "layers (type)", "DTensor", "plain tensor"),
    ("qk_clip_all_", "head_dim", 4, 2),
    ("qk_clip_all_", "threshold", 100.0, 50.0),
    ("qk_clip_all_", "layers (contents, in a list)", "list: a", "list: none"),
    # one rank passes a process_group, the others none: each waited in its own group (issue 41)
    ("qk_clip_all_", "layers (contents, process_group)", "two layers", "none, with a process_group"),
    ("qk_clip_all_", "layers (type, process_group)", "DTensor", "plain tensor, with a process_group"),
    # Muon(step_group=...): checked over the default group at construction (issue 41)
    ("Muon", "step_group", "every rank's group", "a group without this rank"),
    ("Muon", "step_group", "every rank's group", "a group of this rank alone"),
    ("Muon", "step_group", "every rank's group", "another group of the same ranks"),
    # a fake step group in a real job: its sums would hand each rank its own row (issue 49 item 4)
    ("Muon", "step_group", "every rank's group", "a fake group of every rank"),
    # the checkpoint helpers
    ("save_checkpoint", "step", 5, 6),
    ("save_checkpoint", "keep_last", None, 1),
    ("save_checkpoint", "extra", {"data": 1}, {"data": 2}),
    ("save_checkpoint", "root", "ckpt", "other"),
    ("save_checkpoint", "optimizer", "Muon", None),
    # plain replicas with equal weights, one rank's momentum another (issue 49 item 3)
    ("save_checkpoint", "momentum (plain, equal weights)", "the same data", "other data"),
    ("async_save_checkpoint", "step", 5, 6),
    ("async_save_checkpoint", "extra", {"data": 1}, {"data": [1]}),
    ("load_checkpoint", "step", 1, None),
    ("load_checkpoint", "optimizer_state", "load", "fresh"),
    ("load_checkpoint", "optimizer", "Muon", None),
    ("load_checkpoint", "root", "ckpt", "other"),
    ("load_safetensors", "strict", True, False),
    ("load_safetensors", "folder", "hf", "empty"),
    # clip_grad_norm_stages_ (pipeline clipping): the arguments, a bad value on one rank
    ("clip_grad_norm_stages_", "max_norm", 1.0, 2.0),
    ("clip_grad_norm_stages_", "norm_type", 2.0, float("inf")),
    ("clip_grad_norm_stages_", "max_norm (bad)", 1.0, -1.0),
]


class QK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(10, 16, bias=False)  # 4 heads of 4
        self.k = nn.Linear(10, 8, bias=False)  # 2 key heads


class Env:
    """What one case runs on: a fresh sharded model and its optimizer (for the calls that take
    them), and the shared folders."""

    def __init__(self, root: Path, sharded: bool = True) -> None:
        self.root = root
        self.watched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, its local values before)
        if not sharded:  # the model's build, forward and backward: 0.09 s of a rank's CPU per case
            self.model, self.opt = nn.Module(), Muon([nn.Parameter(torch.zeros(2, 2))], lr=0.02)
            return
        self.model = build((dist.get_world_size(),))
        self.opt = Muon(split_params(self.model), lr=0.02)
        torch.manual_seed(1)
        self.model(torch.randint(0, 11, (2, 5))).sum().backward()  # the same gradients on every rank

    def watch(self, *weights: torch.Tensor) -> None:
        self.watched += [(w, _local(w).clone()) for w in weights]

    def unchanged(self) -> bool:
        return all(torch.equal(_local(w), before) for w, before in self.watched)

    def snapshot(self) -> list[torch.Tensor]:
        tensors = [p.detach() for p in self.model.parameters()]
        tensors += [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [_local(t).clone() for t in tensors]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _step(env: Env, arg: str, value: Any) -> None:
    group = env.opt.param_groups[0]
    if arg == "params (order)" and value != "as built":
        group["params"][:2] = group["params"][1::-1]
        group["param_names"][:2] = group["param_names"][1::-1]
    elif arg == "params (contents)" and value != "every matrix":
        del group["params"][-1], group["param_names"][-1]
    elif arg == "gradient" and value == "missing":
        group["params"][0].grad = None
    elif arg == "params (meshes)":  # every rank builds the mesh; one rank alone steps on it
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("extra",))
        if value != "the model's mesh":
            extra = nn.Parameter(DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False))
            extra.grad = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
            env.opt.add_param_group({"params": [extra], "param_names": ["extra.weight"]})
    elif arg == "lr (butterfly, a subset group made first)":
        _butterfly_step(env, value)
        return
    elif arg == "capturable (at construction)":  # refused on this CPU, at the first step on every rank
        env.opt = Muon(split_params(env.model), lr=0.02, capturable=value)
    elif not arg.startswith(("params", "gradient")):
        group[arg] = value
    env.opt.step()


def _butterfly_step(env: Env, lr: float) -> None:
    """A group of rank 0 alone made on every rank first (rank 0 now holds one group more), then the
    step with its check's sum forced through the butterfly's pairs (``sharding/plan/grid.py``)."""
    dist.new_group([0])
    above, grid.GRID_ABOVE = grid.GRID_ABOVE, 1
    try:
        env.opt.param_groups[0]["lr"] = lr
        env.opt.step()
    finally:
        grid.GRID_ABOVE = above


def _qk(mesh: Any, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    model = QK()
    if not plain:
        fully_shard(model, mesh=mesh)
    return model.q.weight, model.k.weight


def _logits(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(4.0) * 60 + 20).to(dtype)  # heads 2, 3 above 100: clipped


def _qk_clip(env: Env, arg: str, value: Any) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k = _qk(mesh, plain=value == "plain tensor")
    kwargs: dict[str, Any] = {"head_dim": 4}
    if arg in ("head_dim", "threshold", "alpha"):
        kwargs[arg] = value
    env.watch(q, k)
    qk_clip_(q, k, _logits(torch.int64 if value == "int" else torch.float32), **kwargs)


def _qk_clip_all(env: Env, arg: str, value: Any) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    (qa, ka), (qb, kb) = _qk(mesh, plain=str(value).startswith("plain tensor")), _qk(mesh)
    env.watch(qa, ka, qb, kb)
    layers: Any = {"a": (qa, ka, _logits()), "b": (qb, kb, _logits())}
    group = dist.new_group(list(range(dist.get_world_size()))) if "process_group" in arg else None
    if str(value).endswith("with a process_group"):
        kwargs_group: dict[str, Any] = {"process_group": group}
        layers = {} if value.startswith("none") else layers
    else:
        kwargs_group = {}
    if value in ("list: a", "list: none"):
        layers = [layers["a"]] if value == "list: a" else []
    elif value == "none":
        layers = {}
    elif value == "b, a":
        layers = dict(reversed(list(layers.items())))
    elif value == "list":
        layers = list(layers.values())
    elif isinstance(value, str) and value.startswith("list: "):
        layers = list(layers.values())[:: 1 if value.endswith("a, b") else -1]
    kwargs: dict[str, Any] = {"head_dim": 4}
    if arg in ("head_dim", "threshold"):
        kwargs[arg] = value
    qk_clip_all_(layers, **kwargs, **kwargs_group)


def _muon(env: Env, arg: str, value: Any) -> None:
    """``Muon(step_group=...)`` built and stepped; every rank makes every group (new_group is collective)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    world, last = list(range(dist.get_world_size())), dist.get_world_size() - 1
    everyone, first, alone, again = (
        dist.new_group(world), dist.new_group([0]), dist.new_group([last]), dist.new_group(world)
    )  # fmt: skip
    fake = dist.new_group(world, backend="fake")
    group = {
        "every rank's group": everyone,
        "a group without this rank": first,
        "a group of this rank alone": alone,
        "another group of the same ranks": again,
        "a fake group of every rank": fake,
    }[value]
    Muon(split_params(env.model), lr=0.02, step_group=group).step()


def _plain_replica(data: str) -> tuple[nn.Module, Muon]:
    """A plain (unsharded) Net on this rank and its optimizer after a step at lr 0 on ``data``: the
    weights stay the seed's, the momentum is the data's."""
    torch.manual_seed(0)
    model = build(None)
    opt = Muon(split_params(model), lr=0.0)
    for group in opt.param_groups:
        group["lr"] = 0.0
    torch.manual_seed(1 if data == "the same data" else 2)
    model(torch.randint(0, 11, (2, 5))).sum().backward()
    opt.step()
    return model, opt


def _save(env: Env, arg: str, value: Any, call: Callable[..., Any] = ckpt.save_checkpoint) -> None:
    if arg.startswith("momentum"):
        model, opt = _plain_replica(value)
        call(env.root / "replicas", 5, model, opt)
        return
    kwargs: dict[str, Any] = {"root": env.root / "saves", "step": 5, "optimizer": env.opt}
    if arg == "root":
        kwargs["root"] = env.root / value
    elif arg == "optimizer":
        kwargs["optimizer"] = env.opt if value else None
    else:
        kwargs[arg] = value
    root, step, optimizer = kwargs.pop("root"), kwargs.pop("step"), kwargs.pop("optimizer")
    result = call(root, step, env.model, optimizer, **kwargs)
    if hasattr(result, "wait"):
        result.wait()


def _load(env: Env, arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"step": 1}
    root, optimizer = env.root / "ckpt", cast(Muon | None, env.opt)
    if arg == "root":
        root = env.root / value
    elif arg == "optimizer":
        optimizer = env.opt if value else None
    else:
        kwargs[arg] = value
    ckpt.load_checkpoint(root, env.model, optimizer, **kwargs)


def _load_safetensors(env: Env, arg: str, value: Any) -> None:
    folder = env.root / (value if arg == "folder" else "hf")
    ckpt.load_safetensors(env.model, folder, **({"strict": value} if arg == "strict" else {}))


def _clip(env: Env, arg: str, value: Any) -> None:
    """Every rank one stage of its own (group: the default group), its gradients watched."""
    env.watch(*[p.grad for p in env.model.parameters() if p.grad is not None])
    kwargs = {"max_norm": 1.0, "norm_type": 2.0, arg.split(" ")[0]: value}
    clip_grad_norm_stages_(env.model.parameters(), **kwargs)


CALLS: dict[str, Callable[[Env, str, Any], None]] = {
    "step": _step,
    "Muon": _muon,
    "qk_clip_": _qk_clip,
    "qk_clip_all_": _qk_clip_all,
    "save_checkpoint": _save,
    "async_save_checkpoint": lambda env, arg, value: _save(env, arg, value, ckpt.async_save_checkpoint),
    "load_checkpoint": _load,
    "load_safetensors": _load_safetensors,
    "clip_grad_norm_stages_": _clip,
}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _setup(root: Path) -> None:
    """A checkpoint at step 1 and its safetensors export, saved by every rank alike."""
    env = Env(root)
    ckpt.save_checkpoint(root / "ckpt", 1, env.model, env.opt)
    if dist.get_rank() == 0:
        ckpt.export_safetensors(root / "ckpt" / "step_00000001", root / "hf")
        (root / "empty").mkdir()
        (root / "other").mkdir()
    dist.barrier()


def one_rank_differs(
    folder: str, rows: list[tuple[str, str, Any, Any]]
) -> list[tuple[str, str, bool, float]]:
    """Rank function: per row, (error type, message, nothing changed here, seconds)."""
    root = Path(folder)
    _setup(root)
    last = dist.get_rank() == dist.get_world_size() - 1
    out = []
    for call, arg, usual, differing in rows:
        env = Env(root, sharded=call not in ("qk_clip_", "qk_clip_all_"))  # those make their own weights
        before, files = env.snapshot(), _files(root)
        start = time.monotonic()
        try:
            CALLS[call](env, arg, differing if last else usual)
            kind, message = "no error", ""
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            kind, message = type(e).__name__, str(e)
        seconds = time.monotonic() - start
        after = env.snapshot()
        same = all(torch.equal(a, b) for a, b in zip(before, after)) and _files(root) == files
        same = same and env.unchanged()
        out.append((kind, message, same, seconds))
        dist.barrier()
    return out


def _check(results: list[list[tuple[str, str, bool, float]]]) -> None:
    for i, (call, arg, usual, differing) in enumerate(ROWS):
        seen = [r[i] for r in results]
        case = f"{call}({arg}={differing!r} on the last rank, {usual!r} elsewhere)"
        kinds = {(kind, message) for kind, message, _, _ in seen}
        assert len(kinds) == 1, f"{case}: the ranks raised different errors: {seen}"
        assert seen[0][0] != "no error", f"{case}: no rank raised"
        assert seen[0][0] in ("ValueError", "RuntimeError", "CheckpointError"), (
            f"{case}: {seen[0]}"
        )  # not a test bug
        assert all(same for _, _, same, _ in seen), f"{case}: a weight, state or file changed"
        assert max(s for _, _, _, s in seen) < BOUND_S, f"{case}: took {max(s for *_, s in seen):.1f} s"


def test_the_table_covers_every_public_call_that_communicates() -> None:
    """Each public call that communicates has rows, and every argument a row names is a real one."""
    assert {call for call, *_ in ROWS} == set(CALLS)
    assert len(ROWS) >= 40, len(ROWS)


# The table's runs: background jobs on pools of their own (tests/harness/background.py, ``apart``),
# beside the session's tests, which leave a core idle while they run in the session alone.
two_ranks_differ = background.apart(
    "two_ranks_differ", one_rank_differs, 2, ROWS, timeout=300, in_folder=True
)
three_ranks_differ = background.apart(
    "three_ranks_differ", one_rank_differs, 3, ROWS, timeout=300, in_folder=True
)


def test_one_rank_differs_on_two_ranks(two_ranks_differ: Any) -> None:
    _check(two_ranks_differ)


@pytest.mark.slow
def test_one_rank_differs_on_three_ranks(three_ranks_differ: Any) -> None:
    _check(three_ranks_differ)
