"""``examples/train.py`` as its docstring says to run it on two nodes: two torchrun agents that meet
through c10d rendezvous on 127.0.0.1, one process each, gloo on CPU. A first run trains and saves,
a second one resumes from the newest checkpoint and goes on; both export safetensors. The two runs
happen in the background of the session (tests/harness/background.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300  # seconds per run; generous because other test suites may share the 2 cores
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch-size", "4"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, *args: str) -> str:
    """Start both agents, wait for both; return their output. Fails on a non-zero exit or a hang."""
    port = _free_port()
    env = background.importable(OMP_NUM_THREADS="1")
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    agents = []
    for node, log in enumerate(logs):
        with open(log, "w") as out:  # the child keeps its own copy of the file descriptor
            agents.append(background.popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                 "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                 "--rdzv_id", "test", str(ROOT / "examples" / "train.py"), *TINY, *args],
                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    try:
        for agent in agents:
            agent.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pass  # reported below with both agents' output
    finally:
        for agent in agents:
            background.kill(agent)  # with its worker
            agent.wait()
    text = [log.read_text(errors="replace") for log in logs]
    codes = [agent.returncode for agent in agents]
    report = "\n".join(
        f"--- node {n}, exit {c} (-9: hung and killed) ---\n{t[-3000:]}"
        for n, (c, t) in enumerate(zip(codes, text, strict=True))
    )
    assert codes == [0, 0], report
    return "\n".join(text)


@background.job("torchrun_agents")
def _train_then_resume(tmp_path: Path) -> tuple[str, dict[str, Any], str, Path]:
    """The first run's output and its step-4 manifest (read before the second run's keep-last may
    prune), the resumed run's output, the checkpoint folder."""
    ckpt = tmp_path / "ckpt"
    first = _two_nodes(tmp_path, "--steps", "4", "--save-every", "2", "--ckpt", str(ckpt))
    manifest = json.loads((ckpt / "step_00000004" / "manifest.json").read_text())
    # --steps 6 past the first run's 4: the cosine schedule is rebuilt on purpose (--stretch-schedule)
    resume = ["--steps", "6", "--save-every", "2", "--log-every", "1", "--ckpt", str(ckpt), "--resume"]
    resume.append("--stretch-schedule")
    return first, manifest, _two_nodes(tmp_path, *resume), ckpt


@pytest.fixture
def torchrun_agents() -> tuple[str, dict[str, Any], str, Path]:
    return background.result("torchrun_agents")


@pytest.mark.slow
def test_two_torchrun_agents_train_resume_and_export(
    torchrun_agents: tuple[str, dict[str, Any], str, Path],
) -> None:
    first, manifest, second, ckpt = torchrun_agents
    assert "FSDP2, mesh (dp=2,)" in first
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
    assert manifest["world_size"] == 2 and manifest["extra"]["data_step"] == 4

    assert f"resumed from {ckpt / 'step_00000004'} (data position 4)" in second
    assert "step 4/6" not in second and "step 5/6 loss" in second and "step 6/6 loss" in second
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]  # keep-last 2

    exported = ckpt / "safetensors" / "model.safetensors"
    with safe_open(str(exported), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open has no __iter__
        assert tuple(f.get_slice("blocks.0.q.weight").get_shape()) == (32, 32)
    assert {"embed.weight", "pos", "lm_head.weight", "blocks.0.down.weight"} <= names
