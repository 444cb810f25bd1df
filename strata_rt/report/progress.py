"""Progress of long prefills on stderr, so stdout stays clean for tables and JSON.

On a terminal one line is redrawn (throttled) per layer; in a log file a line is written per
finished chunk. Short prompts print nothing: progress appears only once a prompt has run for
`delay_s`, so the demo's summary is not buried under redraws.

Progress is not logging: it belongs to the terminal that watches a run, and `strata -q` turns
it off. A log record written while a line is drawn calls `clear_line` first (see report/log.py).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

#: the Progress whose line is drawn now, if any (one terminal line at a time)
_drawn: Progress | None = None


def clear_line(stream: TextIO | None = None) -> None:
    """Clears the progress line drawn on `stream` (any stream when None), if there is one;
    the next redraw puts it back."""
    if _drawn is not None and (stream is None or _drawn.stream is stream):
        _drawn.end()


class Progress:
    """The engine's per-layer callback plus prompt bookkeeping for the CLI.

    `start(label)` opens a prompt; the engine calls the instance as
    `progress(chunk, n_chunks, layer, n_layers)` after it is done with a layer (on the CUDA
    walk: after it issued the layer); `end()` clears the line.
    """

    def __init__(self, stream: TextIO | None = None, enabled: bool = True,
                 delay_s: float = 0.5, interval_s: float = 0.1):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay_s = delay_s
        self.interval_s = interval_s
        self.label = ""
        self.t0 = 0.0
        self._last = 0.0
        self._drawn = False

    def start(self, label: str) -> None:
        self.label = label
        self.t0 = self._last = time.perf_counter()
        self._drawn = False

    def __call__(self, chunk: int, n_chunks: int, layer: int, n_layers: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.t0
        if elapsed < self.delay_s:
            return
        chunk_done = layer + 1 == n_layers
        if self.tty:
            if now - self._last < self.interval_s and not chunk_done:
                return
            done = (chunk * n_layers + layer + 1) / (n_chunks * n_layers)
            bar = "#" * int(done * 20)
            self.stream.write(f"\r\x1b[K{self.label}: chunk {chunk + 1}/{n_chunks} "
                              f"layer {layer + 1}/{n_layers} [{bar:<20}] {elapsed:6.1f} s")
            self.stream.flush()
            self._set_drawn(True)
        elif chunk_done:
            self.stream.write(f"{self.label}: chunk {chunk + 1}/{n_chunks} done "
                              f"({elapsed:.1f} s)\n")
            self.stream.flush()
        self._last = now

    def end(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._set_drawn(False)

    def _set_drawn(self, drawn: bool) -> None:
        global _drawn
        self._drawn = drawn
        if drawn:
            _drawn = self
        elif _drawn is self:
            _drawn = None
