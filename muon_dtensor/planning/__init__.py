"""Capacity planning: the cost model of one optimizer step and the hardware it runs on. Pure
arithmetic over the plan layer (``sharding/plan/``) and the math: it never talks to other ranks,
parses no argument and prints nothing (the ``plan`` command that reads it is
``tools/plan_command.py``). The optimizer reaches it in one place, ``policy.py``, to answer
``owners="auto"`` and ``ns_split="auto"``; nothing below the step imports it
(tests/docs/test_layers.py). ``plan --check`` builds the model on meta tensors and splits it with
``split_params`` (``optim/``), so it lives above the optimizer, in ``tools/launch_check.py``. Its
modules, one by one: row ``planning/`` of docs/design.md's layer table."""
