"""Tools for users: the resume check (``resume_check``, its report ``resume_report``) and the
``plan`` command (``plan_command``, its one parser ``plan_flags``) with its modes: the check before
launch, ``plan --check`` (``launch_check``, its report ``check_report``, over the model ``configs``
it reads), and the rehearsal, ``plan --rehearse`` (``rehearse``: one rank's real step on the fake
backend; ``rehearse_model``, the model's figures beside it; ``rehearse_report``, its bounds and report; ``busiest``, the rank it plays). Row
``tools/`` of docs/design.md's layer table."""
