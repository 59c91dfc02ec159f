"""Tools for users: the resume check (``resume_check``) and the topology check, ``plan --check``
(``topology``). ``testing``, ``launcher`` and ``rank`` are the old paths of ``muon_dtensor.testing``."""
