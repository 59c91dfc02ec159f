"""Tests of muon_dtensor/integrations/ (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
