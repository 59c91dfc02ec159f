"""Tools for users: the resume check (``resume_check``, its report ``resume_report``) and the
topology check, ``plan --check`` (``topology``, over the model ``configs`` it reads), and the
rehearsal, ``plan --rehearse`` (``rehearse``: one rank's real step on the fake backend). Row
``tools/`` of docs/design.md's layer table."""
