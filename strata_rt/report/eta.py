"""A progress line for long host work (loading, converting or checking experts, filling the
store) on stderr: redrawn in place on a terminal, one line every so often in a log, with the
rate and the time left. Work that ends quickly prints nothing."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def format_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s} s"


class Eta:
    """A progress line on stderr with the rate and the time left: redrawn in place on a
    terminal, one line every `log_interval_s` in a log. Nothing appears for work that ends
    within `delay_s`."""

    def __init__(self, label: str, total: int, unit: str, stream: TextIO | None = None,
                 delay_s: float = 1.0, log_interval_s: float = 30.0):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay_s = delay_s
        self.interval_s = 0.2 if self.tty else log_interval_s
        self.t0 = self._last = time.perf_counter()
        self.done = 0
        self.shown = False

    def line(self, now: float) -> str:
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        eta = format_seconds(left) if math.isfinite(left) else "?"
        return (f"{self.label}: {self.done:,}/{self.total:,} {self.unit} "
                f"({self.done / max(1, self.total):.0%}), {rate:,.2f} {self.unit}/s, "
                f"{eta} left")

    def advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.t0 < self.delay_s or (now - self._last < self.interval_s
                                             and self.shown):
            return
        self._last = now
        self.shown = True
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line(now))
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.shown:
            return
        elapsed = time.perf_counter() - self.t0
        end = (f"{self.label}: {self.done:,} {self.unit} in {format_seconds(elapsed)} "
               f"({self.done / max(elapsed, 1e-9):,.2f} {self.unit}/s)")
        self.stream.write(("\r\x1b[K" if self.tty else "") + end + "\n")
        self.stream.flush()
