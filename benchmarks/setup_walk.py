"""The rooms (modules of ``muon_dtensor``) a step walks through, counted by a profiler hook: the
first step (set-up included) and a steady step, one rank of a fake world (torch's ``fake``
backend, one process), 2 layers of 7 matrices (q, k, v, o, w1, w3, w2 shapes scaled down).

*Calls* counts every call of one of the package's functions. A *stay* is a call into a module
other than the caller's (the caller: the nearest frame of the package on the stack; torch's frames
in between are skipped); a *room* is a module entered at least once; a *return* is a stay in a room
entered before (stays - rooms). *Edges* are the distinct
(calling function, called function) pairs that cross modules, the count a reading of the code
gives. *Hops* are the package's frames on the stack, from ``Muon.step`` down to the update
(``numerics.elementwise.apply_updates``), on the steady step. Counts, not times: the host's load
does not change them.

Example, from the repository root::

    python benchmarks/setup_walk.py --out benchmarks/results/setup_walk.json
    python benchmarks/setup_walk.py --revision 93f8f47 --out /tmp/walk_before.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGE = "muon_dtensor"
UPDATE = ("muon_dtensor.numerics.elementwise", "apply_updates")
SHAPES = [(64, 64), (16, 64), (16, 64), (64, 64), (224, 64), (224, 64), (64, 224)]
LAYOUTS = ("fsdp", "hsdp")


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _qualname(frame: FrameType) -> str:
    return str(getattr(frame.f_code, "co_qualname", frame.f_code.co_name))  # co_qualname: Python 3.11+


def _caller(frame: FrameType) -> FrameType | None:
    """The nearest frame of the package above ``frame`` (torch's decorators and hooks skipped)."""
    back = frame.f_back
    while back is not None and not _module(back).startswith(PACKAGE):
        back = back.f_back
    return back


class Walk:
    """A profiler hook that records each stay and, at the update, the package's frames above it."""

    def __init__(self) -> None:
        self.stays: list[str] = []
        self.calls = 0  # every call of a function of the package
        self.edges: set[tuple[str, str]] = set()
        self.hops: int | None = None
        self.before_update: int | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = _module(frame)
        if not module.startswith(PACKAGE):
            return
        self.calls += 1
        caller = _caller(frame)
        if self.hops is None and (module, frame.f_code.co_name) == UPDATE:
            self.hops, self.before_update = _depth(frame), len(self.stays)
        if caller is None or _module(caller) != module:
            self.stays.append(module)
            if caller is not None:
                self.edges.add((f"{_module(caller)}.{_qualname(caller)}", f"{module}.{_qualname(frame)}"))

    def summary(self) -> dict[str, Any]:
        rooms = list(dict.fromkeys(self.stays))
        entered = Counter(self.stays)
        into = Counter(callee.rsplit(".", 1)[0] for _, callee in self.edges)
        short = {m: m.removeprefix(PACKAGE + ".") for m in rooms}
        return {
            "calls": self.calls,
            "rooms": len(rooms),
            "stays": len(self.stays),
            "returns": len(self.stays) - len(rooms),
            "edges": len(self.edges),
            "hops_to_update": self.hops,
            "stays_before_update": self.before_update,
            "stays_per_room": {short[m]: entered[m] for m in rooms},
            "edges_into_room": {short[m]: into[m] for m in rooms if into[m]},
        }


def _depth(frame: FrameType) -> int:
    """The package's frames from ``Muon.step`` (counted as hop 0) down to ``frame``."""
    depth, f = 0, _caller(frame)
    while f is not None and f.f_code.co_name != "step":
        depth, f = depth + 1, _caller(f)
    return depth + 1


def one(layout: str, world: int, rank: int) -> dict[str, Any]:
    """In a fresh process: the walks of ``Muon(...)``, of the first step and of a steady step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from muon_dtensor import Muon

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    shape = (world,) if layout == "fsdp" else (2, world // 2)
    placements = [Shard(0)] if layout == "fsdp" else [Replicate(), Shard(0)]
    mesh = init_device_mesh("cpu", shape)
    gen = torch.Generator().manual_seed(0)
    params = []
    for rows, cols in SHAPES * 2:
        local_shape, _ = compute_local_shape_and_global_offset(torch.Size((rows, cols)), mesh, placements)

        def local(local_shape: Any = local_shape, size: Any = (rows, cols)) -> Any:
            t = torch.randn(local_shape, generator=gen)
            return DTensor.from_local(t, mesh, placements, shape=torch.Size(size), stride=(size[1], 1))

        p = torch.nn.Parameter(local())
        p.grad = local()
        params.append(p)
    walks: dict[str, Any] = {}
    opt = _walked(walks, "construct", lambda: Muon(params, lr=0.02))
    for name in ("first", "steady"):
        _walked(walks, name, opt.step)
    dist.destroy_process_group()
    return walks


def _walked(walks: dict[str, Any], name: str, call: Any) -> Any:
    """``call()``, its walk kept in ``walks[name]``."""
    walk = Walk()
    sys.setprofile(walk)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    walks[name] = walk.summary()
    return out


def _source(revision: str | None, tmp: str) -> Path:
    if not revision:
        return ROOT
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, PACKAGE], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return Path(tmp)


def run_case(layout: str, world: int, source: Path) -> dict[str, Any]:
    code = (  # the package from ``source`` first, as bench_fake_setup.py does
        "import json, sys; sys.path.insert(0, sys.argv[1]); import muon_dtensor;"
        "assert muon_dtensor.__file__.startswith(sys.argv[1]), muon_dtensor.__file__;"
        "sys.path.insert(1, sys.argv[2]); from benchmarks.setup_walk import one;"
        "print(json.dumps(one(sys.argv[3], int(sys.argv[4]), int(sys.argv[4]) - 1)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(source), str(ROOT), layout, str(world)],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    return {"layout": layout, "world": world, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--revision", help="a git revision of the package (default: the working tree)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/setup_walk.json")
    args = parser.parse_args()
    from benchmarks.common import results_config, system_info

    with tempfile.TemporaryDirectory() as tmp:
        source = _source(args.revision, tmp)
        rows = [run_case(layout, args.world, source) for layout in LAYOUTS]
    revision = (
        args.revision
        or subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    result = {"system": system_info(), "config": results_config(args), "revision": revision, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| layout | call | calls | rooms | stays | returns | edges | param_layout stays (edges) "
        "| state stays (edges) | hops to the update | stays before it |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for step in ("construct", "first", "steady"):
            w = r[step]
            pl, st = "sharding.plan.param_layout", "optim.state"
            print(
                f"| {r['layout']} | {step} | {w['calls']} | {w['rooms']} | {w['stays']} | {w['returns']} | {w['edges']} "
                f"| {w['stays_per_room'].get(pl, 0)} ({w['edges_into_room'].get(pl, 0)}) "
                f"| {w['stays_per_room'].get(st, 0)} ({w['edges_into_room'].get(st, 0)}) "
                f"| {w['hops_to_update']} | {w['stays_before_update']} |"
            )


if __name__ == "__main__":
    main()
