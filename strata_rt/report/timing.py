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
from pathlib import Path
from typing import Any

#: phases in the order the table lists them (others follow in order of first appearance)
PHASES = ("input", "dense qkv", "qk norm+rope", "attention", "dense o", "rmsnorm",
          "router gemm", "softmax top-k", "sort", "quantize acts", "host grouping", "wait copy",
          "gather", "gemm gate/up", "swiglu+quantize", "gemm down", "combine", "logits")

NOTE = ("note: STRATA_PREFILL_TIMING=1 records events between phases and launches plainly "
        "(no CUDA graph), so this run is slower than an uninstrumented one")


class PhaseTimer:
    """Marks phase boundaries on the compute stream and copy spans on the copy stream during a
    chunk, and folds them into totals and a trace.

    Events come from pools that grow to the largest chunk and are reused, so a long prompt
    does not create events without bound. The trace (`trace`, Chrome/Perfetto "complete"
    events, microseconds from the prompt's first event) shows the two streams side by side:
    what the table can only summarise, how copies overlap compute."""

    def __init__(self, runtime: Any, stream: Any, copy_stream: Any = None):
        self._rt = runtime
        self._stream = stream
        self._copy_stream = copy_stream
        self._pool: list[Any] = []
        self._marks: list[str] = []
        self._copy_pool: list[Any] = []
        self._copies: list[str] = []
        self._origin = runtime.event("timing origin", timing=True)
        self._origin_recorded = False
        self.totals_ms: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        #: the prompt's trace so far: {"name", "ph": "X", "tid", "ts", "dur"} (microseconds)
        self.trace: list[dict[str, Any]] = []

    def mark(self, phase: str) -> None:
        """Phase `phase` starts at this point of the stream (no-op if it is already running)."""
        if self._marks and self._marks[-1] == phase:
            return
        if not self._origin_recorded:
            self._origin.record(self._stream)
            self._origin_recorded = True
        i = len(self._marks)
        if i == len(self._pool):
            self._pool.append(self._rt.event(f"timing[{i}]", timing=True))
        self._pool[i].record(self._stream)
        self._marks.append(phase)

    def copy_begin(self, label: str) -> None:
        """A copy named `label` is enqueued on the copy stream after this point."""
        if self._copy_stream is None:
            return
        i = 2 * len(self._copies)
        while len(self._copy_pool) < i + 2:
            self._copy_pool.append(self._rt.event(f"copy timing[{len(self._copy_pool)}]",
                                                  timing=True))
        if not self._origin_recorded:
            self._origin.record(self._stream)
            self._origin_recorded = True
        self._copy_pool[i].record(self._copy_stream)
        self._copies.append(label)

    def copy_end(self) -> None:
        """The copy opened by the last copy_begin was enqueued before this point."""
        if self._copy_stream is not None and self._copies:
            self._copy_pool[2 * len(self._copies) - 1].record(self._copy_stream)

    def end_chunk(self) -> None:
        """Closes the chunk's last phase, waits for the streams and adds the chunk's times."""
        self.mark("end")
        self._pool[len(self._marks) - 1].synchronize()
        origin = self._origin
        for i, phase in enumerate(self._marks[:-1]):
            ms = self._pool[i].elapsed_ms(self._pool[i + 1])
            self.totals_ms[phase] += ms
            self.counts[phase] += 1
            self.trace.append({"name": phase, "ph": "X", "tid": "compute",
                               "ts": origin.elapsed_ms(self._pool[i]) * 1e3, "dur": ms * 1e3})
        for n, label in enumerate(self._copies):
            start, end = self._copy_pool[2 * n], self._copy_pool[2 * n + 1]
            end.synchronize()
            self.trace.append({"name": label, "ph": "X", "tid": "copy",
                               "ts": origin.elapsed_ms(start) * 1e3,
                               "dur": start.elapsed_ms(end) * 1e3})
        self._marks = []
        self._copies = []

    def reset(self) -> None:
        """A new prompt: totals, counts and the trace start afresh."""
        self.totals_ms.clear()
        self.counts.clear()
        self.trace = []
        self._origin_recorded = False

    def table(self, wall_s: float | None = None, host_s: float | None = None) -> str:
        return format_table(dict(self.totals_ms), dict(self.counts), wall_s, host_s)


def write_trace(path: str, prompts: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """Writes prompts' traces as one Chrome/Perfetto JSON file (open it in ui.perfetto.dev or
    chrome://tracing): one process lane per prompt, a compute and a copy thread in each.
    Written under a temporary name and renamed, so the file is always whole."""
    import json

    events: list[dict[str, Any]] = []
    for pid, (label, trace) in enumerate(prompts, 1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        for tid, name in ((1, "compute"), (2, "copy")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"{name} stream"}})
        for ev in trace:
            events.append({**ev, "pid": pid, "tid": 1 if ev["tid"] == "compute" else 2})
    from ..config.files.paths import (
        write_text_atomic,  # never renames over what is not a regular file
    )

    write_text_atomic(Path(path), json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


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
