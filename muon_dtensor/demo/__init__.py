"""The main job: ``python -m muon_dtensor demo``."""

from __future__ import annotations

from .run import main

__all__ = ["main"]
