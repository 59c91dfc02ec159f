"""Tests of muon_dtensor/demo/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
