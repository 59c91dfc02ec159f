"""Moved to ``muon_dtensor.testing.rank`` (0.6.0); this path is the same module for one release."""

import sys

from muon_dtensor.testing import rank

sys.modules[__name__] = rank
