"""STRATA_PREFILL_TIMING: where a prompt's GPU time goes, phase by phase.

Events are recorded on the compute stream at phase boundaries; the time from one mark to the
next is charged to the phase of the earlier mark. A stream that sits idle (waiting for a copy,
or for the host to enqueue the next launch) is therefore charged to the phase that waited, which
is what the table is for: it tells a PCIe-bound prompt from a compute- or host-bound one.

The events themselves cost launches and break CUDA-graph replay, so an instrumented run is
slower than a plain one; the table says so.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

#: phases in the order the table lists them (others follow in order of first appearance)
PHASES = ("rmsnorm", "router gemm", "softmax top-k", "sort", "quantize acts", "host grouping",
          "wait copy", "gather", "gemm gate/up", "swiglu+quantize", "gemm down", "combine")

NOTE = ("note: STRATA_PREFILL_TIMING=1 records events between phases and launches plainly "
        "(no CUDA graph), so this run is slower than an uninstrumented one")


class PhaseTimer:
    """Marks phase boundaries on one stream during a chunk and folds them into totals.

    Events come from a pool that grows to the largest chunk and is reused, so a long prompt
    does not create events without bound."""

    def __init__(self, runtime: Any, stream: Any):
        self._rt = runtime
        self._stream = stream
        self._pool: list[Any] = []
        self._marks: list[str] = []
        self.totals_ms: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def mark(self, phase: str) -> None:
        """Phase `phase` starts at this point of the stream (no-op if it is already running)."""
        if self._marks and self._marks[-1] == phase:
            return
        i = len(self._marks)
        if i == len(self._pool):
            self._pool.append(self._rt.event(f"timing[{i}]", timing=True))
        self._pool[i].record(self._stream)
        self._marks.append(phase)

    def end_chunk(self) -> None:
        """Closes the chunk's last phase, waits for the stream and adds the chunk's times."""
        self.mark("end")
        self._pool[len(self._marks) - 1].synchronize()
        for i, phase in enumerate(self._marks[:-1]):
            self.totals_ms[phase] += self._pool[i].elapsed_ms(self._pool[i + 1])
            self.counts[phase] += 1
        self._marks = []

    def reset(self) -> None:
        self.totals_ms.clear()
        self.counts.clear()

    def table(self, wall_s: float | None = None, host_s: float | None = None) -> str:
        return format_table(dict(self.totals_ms), dict(self.counts), wall_s, host_s)


def format_table(totals_ms: dict[str, float], counts: dict[str, int] | None = None,
                 wall_s: float | None = None, host_s: float | None = None) -> str:
    """The phase table of one prompt: GPU ms per phase, share of the stream's time, spans."""
    counts = counts or {}
    order = [p for p in PHASES if p in totals_ms] + [p for p in totals_ms if p not in PHASES]
    total = sum(totals_ms.values())
    lines = [f"{'phase':<18}{'ms':>11}{'share':>8}{'spans':>8}"]
    for p in order:
        share = 100.0 * totals_ms[p] / total if total else 0.0
        lines.append(f"{p:<18}{totals_ms[p]:>11.3f}{share:>7.1f}%{counts.get(p, 0):>8}")
    lines.append(f"{'stream total':<18}{total:>11.3f}")
    if wall_s is not None:
        lines.append(f"{'wall (host clock)':<18}{wall_s * 1e3:>11.3f}")
    if host_s is not None:
        lines.append(f"{'host enqueue':<18}{host_s * 1e3:>11.3f}")
    lines.append(NOTE)
    return "\n".join(lines)
