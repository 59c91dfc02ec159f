"""The checks a step and its callers make before data moves: the one agreement primitive
(``together``), local input checks (``validation``, the parameters' own in ``param_checks``),
per-rank data flags (``preflight``), the agreement's digest of the settings (``agreement``), the step
group's fingerprint (``step_scope``), summed together once per scope (``step_checks``), each group's
checked settings kept until a value changes (``settings_cache``), and the
identity of a step group or QK-Clip process group agreed over the default group
(``group_identity``), and the local warning where a Muon group holds an embedding or an output head
(``wrong_matrix``). Row ``checks/`` of docs/design.md's layer table."""
