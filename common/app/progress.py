"""A dependency-free progress bar for long work (training): redrawn in place on a terminal, a line
every tenth of the way otherwise (logs, CI), always on stderr so stdout stays the result."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """`[#####.....]  750/1500  loss 1.234  9,876 tok/s  12s` for `total` steps."""

    def __init__(
        self, total: int, label: str, stream: TextIO | None = None, width: int = 24
    ) -> None:
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.start = time.perf_counter()
        self.last_line = -1

    def update(self, done: int, fields: str = "") -> None:
        filled = self.width * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"{self.label} [{bar}] {done:>{len(str(self.total))}}/{self.total}  {fields}  {elapsed:.0f}s"
        if self.live:
            self.stream.write("\r" + line)
            if done >= self.total:
                self.stream.write("\n")
        else:
            tenth = 10 * done // max(self.total, 1)
            if tenth > self.last_line or done >= self.total:
                self.last_line = tenth
                self.stream.write(line + "\n")
        self.stream.flush()
