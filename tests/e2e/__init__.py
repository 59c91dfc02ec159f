"""End-to-end runs of the examples and the benchmark scripts (tests/ mirrors the package: CONTRIBUTING.md, "Where a change goes")."""
