"""The runtime: every collective of a step (``comm``), every process group the package creates
(``groups``), and the exchange that runs a plan (``exchange``, ``split_exchange``). Row
``sharding/runtime/`` of docs/design.md's layer table."""
