"""Helpers that tests in several folders share (tests/README.md, "Files")."""
