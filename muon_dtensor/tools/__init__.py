"""Tools for users: ``run_ranks`` (``testing``, with its ``launcher`` and what runs in each ``rank``),
the resume check (``resume_check``, its report ``resume_report``) and the topology check, ``plan
--check`` (``topology``, over the model ``configs`` it reads). Row ``tools/`` of docs/design.md's
layer table."""
