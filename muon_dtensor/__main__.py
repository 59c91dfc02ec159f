"""``python -m muon_dtensor demo [options]`` or ``python -m muon_dtensor plan [options]``."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: python -m muon_dtensor {demo,plan} [options]
       python -m muon_dtensor --version

  demo   train a small model with FSDP2 on 2 CPU ranks, crash, resume on 1 rank, compare
  plan   predict one Muon optimizer step for a model on N GPUs from the cost model;
         plan --check CONFIG --gpus N: check its layouts and memory before launch;
         plan --rehearse CONFIG --gpus N (--rank R | --busiest): run one rank's real step on the
         fake backend

Each takes --help: plan --help lists every mode's options."""


# Each subcommand is one module's ``main(argv) -> int``, whose one parser reads all its options.
COMMANDS = {"demo": ".demo", "plan": ".tools.plan_command"}


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; return its exit status (2, the reason and the usage for an unknown one)."""
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in COMMANDS:
        return int(importlib.import_module(COMMANDS[command], __package__).main(rest))
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command in ("-V", "--version"):
        from . import __version__

        print(f"muon_dtensor {__version__}")
        return 0
    reason = "no command given" if not command else f"unknown command {command!r}"
    print(f"error: {reason}: choose demo or plan\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
