"""Tests of muon_dtensor/tools/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
