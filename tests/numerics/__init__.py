"""Tests of muon_dtensor/numerics/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
