"""The runtime: every collective of a step (``comm``), a failure inside a step told to the peers
(``failures``), every process group the package creates (``groups``), and the exchange that runs a
plan (``exchange``, ``split_exchange``). Row
``sharding/runtime/`` of docs/design.md's layer table."""
