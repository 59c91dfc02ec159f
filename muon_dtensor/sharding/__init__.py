"""Where shards live and how they move. ``plan/`` is plain frozen data from pure functions (blocks,
matrix views, owners, routes, copies, memory); ``runtime/`` moves data along it (every collective and
every process group the package creates). Internal: the optimizer and the checkpoints are its clients."""
