"""Tests of muon_dtensor/features/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
