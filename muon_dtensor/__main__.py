"""``python -m muon_dtensor demo [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "demo":
        print("usage: python -m muon_dtensor demo [--help]", file=sys.stderr)
        return 2
    from .demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
