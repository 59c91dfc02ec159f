"""Tools for users: the resume check (``resume_check``, its report ``resume_report``) and the
``plan`` command (``plan_command``, its one parser ``plan_flags``) with its modes: the check before
launch, ``plan --check`` (``launch_check``, its report ``check_report``, over the model ``configs``
it reads), and the rehearsal, ``plan --rehearse`` (``rehearse``: one rank's real step on the fake
backend; ``rehearse_report``, its bounds and report; ``busiest``, the rank it plays). ``testing``,
``launcher`` and ``rank`` are the old paths of ``muon_dtensor.testing``, kept for one release. Row
``tools/`` of docs/design.md's layer table."""

from ..base.moved import keep_old_paths

keep_old_paths(
    __name__,
    {
        "testing": "muon_dtensor.testing.runner",
        "launcher": "muon_dtensor.testing.launcher",
        "rank": "muon_dtensor.testing.rank",
    },
)  # 0.6
