"""A progress line on a terminal (stderr): done/total, rate, elapsed.  Silent otherwise."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, enabled: bool = True, unit: str = "files", stream=None):
        self.label = label
        self.enabled = enabled
        self.unit = unit
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._last:
            self.stream.write("\n")
            self.stream.flush()

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and (total is None or done < total):
            return
        self._last = now
        elapsed = now - self.t0
        rate = done / elapsed if elapsed > 0 else 0.0
        if total:
            width = 30
            filled = int(width * done / total)
            bar = "#" * filled + "-" * (width - filled)
            line = f"\r{self.label} [{bar}] {done}/{total} {self.unit} {rate:.0f}/s {elapsed:.1f}s {note}"
        else:
            line = f"\r{self.label} {done} {self.unit} {rate:.0f}/s {elapsed:.1f}s {note}"
        self.stream.write(line[:200])
        self.stream.flush()
