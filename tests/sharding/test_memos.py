"""The plan's memos let go: every memo of ``sharding/plan/`` keyed by a mesh, group, plan or blocks
tuple is a ``base.weak_memo.WeakMemo``, so a mesh the user drops is freed with its memo, and a later
mesh (which may take the dropped one's id) never meets the dropped mesh's ranks or block orders.

Regression: ``param_layout._MEMOS`` was keyed by ``id(mesh)`` and held each mesh (so its id stayed
its own), up to 64 meshes with their process groups, alive until 64 others pushed them out."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from muon_dtensor.base.weak_memo import WeakMemo
from muon_dtensor.sharding.plan import param_layout
from muon_dtensor.sharding.plan.param_layout import describe
from tests.sharding.conftest import RANK


def _param(shape: tuple[int, ...]) -> DTensor:
    """A ``(4 * shards, 8)`` matrix sharded by rows over the last axis of a mesh of ``shape`` and
    replicated over the others (HSDP)."""
    mesh = init_device_mesh("cpu", shape)
    placements = [Replicate()] * (len(shape) - 1) + [Shard(0)]
    size = torch.Size((4 * shape[-1], 8))
    return DTensor.from_local(torch.zeros(4, 8), mesh, placements, shape=size, stride=(8, 1), run_check=False)


def test_a_dropped_mesh_is_freed_and_a_new_mesh_gets_its_own_layout(fake_world: None) -> None:
    p = _param((2, 8))
    layout = describe(p, "w", None, planned=True)
    assert len(layout.blocks) == 8 and param_layout._MEMOS.get(p.device_mesh) is not None
    mesh = weakref.ref(p.device_mesh)
    del p, layout
    gc.collect()
    assert mesh() is None, "a memo kept a dropped mesh alive"
    for shape in [(4, 4), (16,), (8, 2)]:  # new meshes, one of which may take the old id
        q = _param(shape)
        layout = describe(q, "w", None, planned=True)
        me = RANK % shape[-1]  # the ranks of a row of the mesh (row-major), read through the memo
        assert layout.members == tuple(range(RANK - me, RANK - me + shape[-1])) and layout.rank == me
        assert layout.blocks[me] == (((4 * me, 4 * me + 4),), ((0, 8),))
        del q, layout  # its mesh, freed or not, must not matter to the next


class _Key:
    pass


def test_the_memo_drops_a_weak_key_and_never_hands_its_value_to_another_object() -> None:
    memo: WeakMemo[str] = WeakMemo()
    first = _Key()
    memo.put(first, "first")
    assert memo.get(first) == "first" and len(memo) == 1
    gone = weakref.ref(first)
    del first  # no cycle: freed at once
    assert gone() is None and len(memo) == 0
    # an id taken again by another object: dead objects' ids are reused at once for a same-size one
    seen = set()
    for _ in range(200):
        other = _Key()
        seen.add(id(other))
        assert memo.get(other) is None
        memo.put(other, "other")
        del other
    assert len(memo) == 0 and len(seen) < 200  # ids were reused, and no value outlived its key


def test_a_tuple_key_is_held_so_its_id_stays_its_own() -> None:
    memo: WeakMemo[int] = WeakMemo(limit=2)
    key = tuple(range(5))
    memo.put(key, 1)
    assert memo.get(key) == 1 and memo.get(tuple(range(5))) is None  # by identity, not by value
    memo.put((1,), 2)
    memo.put((2,), 3)  # the limit: cleared before this one
    assert len(memo) == 1 and memo.get(key) is None


def test_no_module_of_the_plan_keys_anything_by_id() -> None:
    """``id()`` appears in no module of ``sharding/plan/``: a memo there is a ``WeakMemo``, which owns
    the identity lookup. (build.py's holders memo once keyed a dict by ``id(blocks)`` itself.)"""
    import ast
    from pathlib import Path

    folder = Path(param_layout.__file__).parent
    calls = [
        f"{path.name}:{node.lineno}"
        for path in sorted(folder.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "id"
    ]
    assert calls == [], calls
