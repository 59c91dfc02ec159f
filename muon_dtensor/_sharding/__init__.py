"""Where shards live and how they move: blocks, parameter layouts, matrix views, plans, the exchange
and every collective. Internal: the optimizer and the checkpoint helpers are its clients."""
