"""The optimizer shell: ``Muon`` (``optimizer``), one step over a group (``functional``), its state
plumbing (``state``), a group's sharding set up where the step starts (``group_sharding``), the
``"auto"`` answers (``policy``), ``split_params`` (``param_groups``) and ``describe``/``memory``
(``report``)."""
