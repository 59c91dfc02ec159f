"""Where the test suite's CPU goes: run pytest (or read a run's samples) and account the CPU seconds
of every process under it, by kind (the session, the rank pools with the zygote that forks them, ``run_ranks``'s launchers and
their ranks, torchrun, forkrun, the demo, other subprocesses), sampled from /proc each second.

    python benchmarks/suite_cpu.py --out benchmarks/results/suite_cpu.json -- -q -m "not slow"
    python benchmarks/suite_cpu.py --samples run.samples --out ...   # account a run sampled before

CPU seconds, unlike wall time, hold on a shared host: they count what the suite's own processes
ran, whatever else the cores did. A process that lives under a second between two samples is
missed (its CPU shows in the wrapper's ``RUSAGE_CHILDREN`` total). Linux only.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from muon_dtensor.demo.run import environment

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK  # parent, own user + system


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _running(pid: int) -> bool:
    """``pid`` lives: its /proc entry exists and it is not a zombie (an exited child stays in /proc,
    state Z, until its parent waits for it, and the parent waits only after sampling ends)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def sample(root: int, out: Path, interval: float = 1.0) -> None:
    """Each ``interval``, one JSON line: the time, and each process under ``root`` with its CPU seconds
    (``new``: the command lines of processes first seen)."""
    seen: set[int] = set()
    with out.open("w") as f:
        while _running(root):
            children: dict[int, list[int]] = collections.defaultdict(list)
            for entry in os.listdir("/proc"):
                if entry.isdigit() and (st := _stat(int(entry))):
                    children[st[0]].append(int(entry))
            tree, todo = [], [root]
            while todo:
                pid = todo.pop()
                tree.append(pid)
                todo.extend(children.get(pid, []))
            cpu = {pid: [st[1], 0] for pid in tree if (st := _stat(pid))}
            new = {pid: _cmdline(pid) for pid in cpu if pid not in seen}
            seen |= set(cpu)
            f.write(json.dumps({"t": round(time.time(), 2), "cpu": cpu, "new": new}) + "\n")
            f.flush()
            time.sleep(interval)


def kind(cmd: str) -> str:
    """What a process is, from the command line it was started (or forked) with."""
    rules = [
        ("-m pytest", "pytest (the session)"),
        ("harness.ranks", "rank pools"),
        ("harness.zygote", "rank pools"),  # the zygote, and the launchers and workers it forks
        ("tests.ranks", "rank pools"),
        ("launcher", "run_ranks launchers and ranks"),
        ("muon_dtensor.testing.rank", "run_ranks spawned ranks"),
        ("forkrun", "forkrun"),
        ("torchrun", "torchrun"),
        ("torch.distributed.run", "torchrun"),
        ("demo", "demo runs"),
    ]
    for needle, name in rules:
        if needle in cmd:
            return name
    return "other subprocesses"


def account(samples: Path) -> dict:
    """CPU seconds by kind, and per minute, from a samples file."""
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    cmd: dict[str, str] = {}
    last: dict[str, float] = {}
    per_minute: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        cmd.update({p: c for p, c in row["new"].items() if p not in cmd})
        minute = int((row["t"] - rows[0]["t"]) // 60)
        for pid, (cpu, _) in row["cpu"].items():
            per_minute[minute][kind(cmd.get(pid, ""))] += cpu - last.get(pid, 0.0)
            last[pid] = max(last.get(pid, 0.0), cpu)
    wrappers = {p for p, c in cmd.items() if not re.search(r"python", c)}
    total = collections.Counter()
    for pid, cpu in last.items():
        if pid not in wrappers:
            total[kind(cmd.get(pid, ""))] += cpu
    return {
        "span_s": round(rows[-1]["t"] - rows[0]["t"], 1),
        "processes": len(last),
        "cpu_s": {k: round(v, 1) for k, v in total.most_common()},
        "cpu_s_total": round(sum(total.values()), 1),
        "per_minute": {
            m: {k: round(v, 1) for k, v in c.most_common() if v >= 0.5} for m, c in sorted(per_minute.items())
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the results file (JSON)")
    parser.add_argument("--samples", type=Path, help="account this samples file instead of running pytest")
    parser.add_argument(
        "--note", default="", help="what was run, for a --samples file (commit, command, load)"
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args()
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # which kind of host: the suite's time on a Zen 3 with AVX2 only was twice a Zen 4's (stop 62)
        "host": {"machine": platform.machine(), **environment()},
        "python": platform.python_version(),
        "note": args.note,
    }
    samples = args.samples
    # the load when this script starts: a run's start, or for --samples only the accounting's
    result["host"]["load_at_start" if samples is None else "load_when_accounted"] = os.getloadavg()
    if samples is None:
        samples = args.out.with_suffix(".samples")
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *args.pytest_args])
        sample(proc.pid, samples)
        result["returncode"] = proc.wait()
        result["wall_s"] = round(time.monotonic() - start, 1)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["rusage_children_cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
        result["pytest_args"] = args.pytest_args
    result["accounting"] = account(samples)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| kind | CPU s |\n|---|---|")
    for name, cpu in result["accounting"]["cpu_s"].items():
        print(f"| {name} | {cpu} |")
    print(f"| all | {result['accounting']['cpu_s_total']} |")


if __name__ == "__main__":
    main()
