"""Tests of muon_dtensor/planning/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
