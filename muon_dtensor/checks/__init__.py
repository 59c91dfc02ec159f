"""The checks a step and its callers make before data moves: local input checks (``validation``),
per-rank data flags (``preflight``), the agreement's digest of the settings (``agreement``), summed
together once per scope (``step_checks``), and what parameters' names say (``names``)."""
