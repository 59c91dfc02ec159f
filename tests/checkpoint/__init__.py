"""Tests of muon_dtensor/checkpoint/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
