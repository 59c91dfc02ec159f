"""Tests of muon_dtensor/optim/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
