"""Tests across the package: the docs against the code, the layers (tests/ mirrors the package: CONTRIBUTING.md, "Where a change goes")."""
