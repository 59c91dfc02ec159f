"""The tests' multi-rank runner is the package's own (muon_dtensor/launch.py)."""

from __future__ import annotations

from muon_dtensor.demo.launch import run_ranks

__all__ = ["run_ranks"]
