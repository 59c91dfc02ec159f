"""The plan: who orthogonalizes which matrix, what each rank sends, receives and copies, and the
transient bytes of a step, as plain frozen data from pure functions. Testable for 1,024 ranks with no
process; never talks to other ranks. Its modules, one by one: row ``sharding/plan/`` of
docs/design.md's layer table."""
