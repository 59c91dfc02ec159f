"""Tools for users: the resume check (``resume_check``, its report ``resume_report``) and the
topology check, ``plan --check`` (``topology``, over the model ``configs`` it reads). ``testing``,
``launcher`` and ``rank`` are the old paths of ``muon_dtensor.testing``, kept for one release. Row
``tools/`` of docs/design.md's layer table."""
