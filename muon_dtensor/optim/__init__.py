"""The optimizer shell: ``Muon`` (``optimizer``), one step over a group (``functional``), its state
plumbing (``state``), a group's sharding set up where the step starts (``group_sharding``) and kept
until its parameters change (``plan_cache``), the ``"auto"`` answers (``policy``), ``split_params``
(``param_groups``), ``describe``/``memory`` (``report``) and the shared docstring text
(``docstrings``). Row ``optim/`` of docs/design.md's layer table."""
