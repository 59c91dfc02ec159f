"""The plan: who orthogonalizes which matrix, what each rank sends, receives and copies, and the
transient bytes of a step, as plain frozen data from pure functions. Testable for 1,024 ranks with no
process; never talks to other ranks. Its modules, one by one: row ``sharding/plan/`` of
docs/design.md's layer table."""

from ...base.moved import keep_old_paths

keep_old_paths(__name__, {"compat": "muon_dtensor.base.compat"})  # moved in 0.6 (CHANGELOG.md)
