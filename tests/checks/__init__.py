"""Tests of muon_dtensor/checks/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
