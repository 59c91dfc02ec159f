"""Benchmark scripts, run from the repository root (``python benchmarks/<name>.py``).

A regular package, so ``from benchmarks import ...`` finds this folder first on ``PYTHONPATH`` and
an installed distribution that ships a top-level ``benchmarks`` cannot shadow it.
"""
