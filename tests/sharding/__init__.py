"""Tests of muon_dtensor/sharding/ (plan/ and runtime/) (the folders of tests/ mirror the package: CONTRIBUTING.md, "Where a change goes")."""
