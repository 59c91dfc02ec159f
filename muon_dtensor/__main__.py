"""``python -m muon_dtensor demo [options]`` or ``python -m muon_dtensor plan [options]``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m muon_dtensor {demo,plan} [options]
       python -m muon_dtensor --version

  demo   train a small model with FSDP2 on 2 CPU ranks, crash, resume on 1 rank, compare
  plan   predict one Muon optimizer step for a model on N GPUs from the cost model;
         plan --check CONFIG --gpus N: check its layouts and memory before launch;
         plan --rehearse CONFIG --gpus N --rank R: run rank R's real step on the fake backend

Each takes --help (also plan --check --help and plan --rehearse --help)."""


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; return its exit status (2, the reason and the usage for an unknown one)."""
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "plan" and any(a == "--check" or a.startswith("--check=") for a in rest):
        from .tools.topology import main as check_main  # the check before launch

        return check_main(rest)
    if command == "plan" and any(a == "--rehearse" or a.startswith("--rehearse=") for a in rest):
        from .tools.rehearse import main as rehearse_main  # one rank's real step, fake backend

        return rehearse_main(rest)
    if command == "plan":
        from .planning.cli import main as plan_main

        return plan_main(rest)
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
