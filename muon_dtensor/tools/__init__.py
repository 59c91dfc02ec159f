"""Tools for users: ``run_ranks`` (``testing``), the resume check (``resume_check``) and the topology
check, ``plan --check`` (``topology``)."""
