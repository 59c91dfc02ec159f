"""Tests of muon_dtensor/base/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
