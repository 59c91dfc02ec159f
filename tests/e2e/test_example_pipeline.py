"""``examples/pipeline.py`` end to end (gloo on CPU): 2 stages x 2
FSDP2 shards on 4 ranks train and die right after step DIE's save; from that checkpoint, 2 ranks
resume with the stages merged (FSDP2, one Muon, no pipeline) and 4 ranks resume on the stages; each
finishes at step STEPS with the weights of an uninterrupted 4-rank run, bit for bit (the example
prints a sha256 over every parameter, and the final loss in full) and the same logged loss at every
step. The four launches run once, two at a time, in the background of the session
(tests/harness/background.py): the uninterrupted one by torchrun, as the example's docstring runs it, the
others by ``tests/harness/forkrun.py`` (torchrun's environment, the ranks forked from one process that
imported torch once: no agent and no interpreter per rank)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import background

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipeline.py"
TIMEOUT = 300  # seconds per launch; one took 18 to 29 s on the 2 shared cores, two at a time
STEPS, SAVE, DIE = 6, 2, 4
COMMON = ("--steps", str(STEPS), "--save-every", str(SAVE))


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    seconds: float

    def losses(self) -> dict[int, str]:
        """Step -> the loss rank 0 logged, as printed."""
        return {int(s): loss for s, loss in re.findall(r"^step (\d+)/\d+ loss (\S+)$", self.out, re.M)}

    def final(self) -> str:
        lines = [line for line in self.out.splitlines() if line.startswith("final step ")]
        assert len(lines) == 1, f"no single final line (exit {self.code}):\n{self.out[-4000:]}"
        return lines[0]


def _torchrun(cwd: Path, ranks: int, ckpt: str, *flags: str, forked: bool = True) -> Run:
    """One launch in its own process group (killed whole on a hang); its output, exit code, time.
    ``forked``: by tests/harness/forkrun.py, torchrun's environment in ranks forked from one process;
    otherwise by torchrun itself."""
    env = background.importable(OMP_NUM_THREADS="1")
    if forked:
        command = [sys.executable, "-m", "tests.harness.forkrun", str(ranks)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command += [str(EXAMPLE), *COMMON, "--ckpt", ckpt, *flags]
    clock = time.perf_counter()
    proc = background.popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        background.kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(command[4:])} hung past {TIMEOUT} s:\n{out[-4000:]}") from None
    return Run(proc.returncode, out, time.perf_counter() - clock)


@background.job("pipeline_runs")
def _launch_all(tmp: Path) -> tuple[dict[str, Run], Path]:
    """died (4 ranks, --die-at DIE), merged and stages (resumed from its checkpoint, each on its own
    copy), straight (4 ranks, uninterrupted); and ``tmp``, whose folder ``pristine`` keeps the died
    run's checkpoints."""
    with ThreadPoolExecutor(2) as pool:  # two at a time: 53 s in all on 2 cores, against 88 s one by one
        straight = pool.submit(_torchrun, tmp, 4, "straight", forked=False)  # as the docstring runs it
        out = {"died": _torchrun(tmp, 4, "died", "--die-at", str(DIE))}
        for name in ("pristine", "stages"):
            shutil.copytree(tmp / "died", tmp / name)
        stages = pool.submit(_torchrun, tmp, 4, "stages", "--resume")
        out["merged"] = _torchrun(tmp, 2, "died", "--resume", "--merged")
        out.update(stages=stages.result(), straight=straight.result())
    return out, tmp


@pytest.fixture(scope="module")
def pipeline_runs() -> tuple[dict[str, Run], Path]:
    """``_launch_all``'s runs, launched in the background of the session (tests/harness/background.py)."""
    out, tmp = background.result("pipeline_runs")
    for name, run in out.items():
        print(f"{name}: exit {run.code}, {run.seconds:.1f} s")
    return out, tmp


@pytest.mark.slow
def test_the_run_dies_right_after_its_save(pipeline_runs: tuple[dict[str, Run], Path]) -> None:
    runs, tmp = pipeline_runs
    died, straight = runs["died"], runs["straight"]
    assert died.code != 0, died.out[-4000:]
    assert f"--die-at {DIE}: every rank exits now" in died.out and "final step" not in died.out
    assert died.losses() == {s: straight.losses()[s] for s in range(1, DIE + 1)}, died.out[-4000:]
    saved = sorted(p.name for p in (tmp / "pristine").glob("step_*"))
    assert saved == [f"step_{DIE - SAVE:08d}", f"step_{DIE:08d}"]  # keep-last 2
    manifest = json.loads((tmp / "pristine" / saved[-1] / "manifest.json").read_text())
    assert manifest["extra"] == {"data_step": DIE} and manifest["world_size"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["merged", "stages"])
def test_the_resumed_run_ends_bitwise_as_the_uninterrupted_one(
    pipeline_runs: tuple[dict[str, Run], Path], resumed: str
) -> None:
    runs = pipeline_runs[0]
    run, straight = runs[resumed], runs["straight"]
    assert run.code == 0 and straight.code == 0, f"{run.out[-4000:]}\n{straight.out[-4000:]}"
    ckpt, layout = ("died", "merged") if resumed == "merged" else ("stages", "2 stages")
    assert f"resumed step {DIE} from {ckpt} ({layout})" in run.out, run.out[-4000:]
    assert len(straight.losses()) == STEPS
    assert run.losses() == {s: straight.losses()[s] for s in range(DIE + 1, STEPS + 1)}
    assert run.final() == straight.final()  # the final loss and the sha256 of every weight
