"""The parts of ``benchmarks/gpu_check.py``, the one prepared check of the GPU path.

``batch`` (a), ``ns_speed`` (b, also behind ``gpu_ns.py``), ``step`` (c), ``graphs`` (d) and
``ranks`` (e) are the parts; ``common`` holds the settings, timers and the part runner,
``estimate`` the run's settings and its time estimate from the shapes' flops, ``report`` the table.
"""
