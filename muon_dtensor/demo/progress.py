"""A text progress bar on stderr for work done in other processes.

Rank 0 writes ``"step total"`` to a file after each step (``train._progress``) and appends its log
lines (``log.log_line``) to ``<file>.log``; a thread of the parent process reads both, prints new log
lines above the bar and redraws it. On a terminal the bar redraws in place; otherwise (CI logs,
pipes) the log lines and the finished line are printed at the end.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]

WIDTH = 30


def _read(path: Path) -> tuple[int, int] | None:
    try:
        step, total = path.read_text().split()
        return int(step), int(total)
    except (OSError, ValueError):
        return None


class Progress:
    """``with Progress(label, path): run_ranks(...)`` draws ``label |#####     | 12/40 steps 3 s``."""

    def __init__(self, label: str, path: str | Path, *, stream: TextIO | None = None) -> None:
        self.label, self.path = label, Path(path)
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._start = 0.0
        self.log = Path(str(self.path) + ".log")
        self._shown = 0  # log lines printed so far

    def __enter__(self) -> Progress:
        self.path.unlink(missing_ok=True)
        self.log.unlink(missing_ok=True)
        sys.stdout.flush()  # what was printed before the bar comes before it
        self._start = time.monotonic()
        if self.live:
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self.live:
            self._thread.join()
        self._draw(end="\n")

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._draw(end="")

    def line(self) -> str:
        done = _read(self.path)
        elapsed = time.monotonic() - self._start
        if done is None:
            return f"{self.label} |{' ' * WIDTH}| starting {elapsed:4.0f} s"
        step, total = done
        filled = WIDTH * step // max(total, 1)
        return f"{self.label} |{'#' * filled}{' ' * (WIDTH - filled)}| {step}/{total} steps {elapsed:4.0f} s"

    def _new_log_lines(self) -> list[str]:
        try:
            lines = self.log.read_text().splitlines(keepends=True)
        except OSError:
            return []
        complete = [line.rstrip("\n") for line in lines if line.endswith("\n")]
        new, self._shown = complete[self._shown :], len(complete)
        return new

    def _draw(self, *, end: str) -> None:
        prefix = "\r\033[K" if self.live else ""
        for line in self._new_log_lines():
            self.stream.write(f"{prefix}  {line}\n")
        self.stream.write(("\r" if self.live else "") + self.line() + end)
        self.stream.flush()
