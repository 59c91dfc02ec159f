"""The README's list of the demo's options is the demo's argparse options, no more, no fewer."""

from __future__ import annotations

import re
from pathlib import Path

from muon_dtensor.demo.run import _parser

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_demo_option() -> None:
    demo = README.read_text().split("\n## The demo\n", 1)[1].split("\n## ", 1)[0]
    paragraph = re.search(r"^Options: .*?(?=\n\n|\Z)", demo, re.S | re.M)
    assert paragraph, "README.md's demo section lost its 'Options:' paragraph"
    listed = set(re.findall(r"`(--[a-z][\w-]*)", paragraph.group(0)))
    options = {s for a in _parser()._actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    assert listed == options, (
        f"README lacks {sorted(options - listed)}; lists unknown {sorted(listed - options)}"
    )
