"""docs/images/ is current: each picture's sidecar names the results file it was drawn from
(benchmarks/figures.py), with that file's sha256 and the PNG's. A results file changed without
redrawing, a PNG edited or replaced by hand, or a picture without its sidecar fails; no matplotlib
needed (hashes only)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
PNGS = sorted(IMAGES.glob("*.png"))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_there_are_pictures() -> None:
    assert {p.stem for p in PNGS} >= {"demo_resume", "momentum_memory", "muon_vs_adamw", "plan_scaling"}


@pytest.mark.parametrize("png", PNGS, ids=[p.stem for p in PNGS])
def test_each_picture_is_current_with_its_results_file(png: Path) -> None:
    sidecar = json.loads(png.with_suffix(".json").read_text())
    results = ROOT / sidecar["results"]
    assert results.parent == ROOT / "benchmarks" / "results", sidecar["results"]
    assert _sha(results) == sidecar["results_sha256"], (
        f"{sidecar['results']} changed since {png.name} was drawn: run python benchmarks/figures.py {png.stem}"
    )
    assert _sha(png) == sidecar["png_sha256"], f"{png.name} is not the one benchmarks/figures.py drew"
    assert sidecar["results_sha256"].encode() in png.read_bytes()  # recorded in the PNG's own metadata too


def test_the_readme_shows_a_picture_on_its_first_screen() -> None:
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "](docs/images/" in first
