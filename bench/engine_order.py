"""A MoE layer's per-group work timed as the engine issues it (shared by bench_gemm.py and
bench_mmq.py; imports neither, only their shared mmq_common.py).

The engine does not launch a layer's 8 gate/up GEMMs and then its 8 down GEMMs on one stream:
it walks the groups of 16 experts in order, and group g's gather (when the experts are not
already in the group buffers), gate/up GEMM, SwiGLU and down GEMM all go on compute lane
LANES[g % lanes] (strata_rt/schedule/plan.py), with the second lane forked off the compute stream by
an event and joined back by another before the combine; and the walk is captured once as a CUDA
graph and replayed (strata_rt/runtime/graph.py). `EngineOrder.measure` times that: the caller's
`group(stream, g)` for g = 0..n_groups-1, captured once into a graph on the benchmark stream and
replayed there, on one lane (every group on that stream) and on two (group g on stream g % 2,
the second a stream of its own forked at the start and joined at the end inside the capture,
as the engine's DeviceState.joined does), plus the form the engine picks for the chunk
(strata_rt.schedule.vram.lanes.chunk_lanes with both lane buffer sets allocated, as when every
expert is resident). Each replay is timed with the caller's event timer on the benchmark stream:
median of `reps` after WARMUPS warm-up replays (mmq_common.median_ms's rule).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmq_common import WARMUPS  # noqa: E402

from strata_rt.runtime.graph import capture  # noqa: E402
from strata_rt.schedule.vram.lanes import chunk_lanes  # noqa: E402
from strata_rt.weights.model import MoESpec  # noqa: E402

#: the lane counts measured, with their JSON keys and table headers
FORMS = {1: ("graph_1_lane", "graph 1 lane"), 2: ("graph_2_lanes", "graph 2 lanes")}

Group = Callable[[Any, int], None]


def layer_spec(hidden: int, ffn: int, n_experts: int, top_k: int) -> MoESpec:
    """The geometry chunk_lanes reads (one layer)."""
    return MoESpec(n_layers=1, hidden=hidden, ffn=ffn, n_experts=n_experts, top_k=top_k)


class EngineOrder:
    """Captures and replays a layer's groups on one or two compute lanes.

    `stream` is the benchmark stream (the one `timer` records its events on): lane 1, the
    stream every graph is captured on and replayed on. Lane 2 is a runtime stream of its own."""

    def __init__(self, rt: Any, stream: Any, timer: Callable[[Callable[[], Any]], float]):
        self.rt, self.timer = rt, timer
        self.lanes = (stream, rt.stream("lane 2"))
        self.fork, self.join = rt.event("lane fork"), rt.event("lane join")

    def issue(self, group: Group, n_groups: int, lanes: int) -> None:
        """Enqueues the groups in engine order: group g on lane g % lanes, lane 2 forked off
        lane 1 first and joined back last (nothing allocates or synchronizes here)."""
        s1, s2 = self.lanes
        if lanes > 1:
            self.fork.record(s1)
            s2.wait(self.fork)
        for g in range(n_groups):
            group(self.lanes[g % lanes], g)
        if lanes > 1:
            self.join.record(s2)
            s1.wait(self.join)

    def graph_ms(self, group: Group, n_groups: int, lanes: int, reps: int) -> float:
        """Median ms of one replay of the groups captured in engine order on `lanes` lanes."""
        s1 = self.lanes[0]
        # one pass un-captured first: kernels loaded and, for the CUTLASS GEMM, an argument
        # block bound to each lane's stream (a stream first seen inside a capture could only
        # take a spare one)
        self.issue(group, n_groups, lanes)
        s1.synchronize()
        with capture(self.rt, s1) as graph:
            self.issue(group, n_groups, lanes)
        try:
            for _ in range(WARMUPS):
                graph.launch(s1)
            return statistics.median(self.timer(lambda: graph.launch(s1)) for _ in range(reps))
        finally:
            s1.synchronize()
            graph.free()

    def measure(self, group: Group, n_groups: int, reps: int, tokens: int, spec: MoESpec,
                flops: float) -> dict:
        """{graph_1_lane, graph_2_lanes, engine}: each {"ms", "tflops"} (flops / time); engine
        also has "lanes", the form chunk_lanes(2, tokens, spec) picks (its time is that form's
        measurement, not a third one)."""
        res: dict = {}
        for lanes, (key, _) in FORMS.items():
            ms = self.graph_ms(group, n_groups, lanes, reps)
            res[key] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        pick = chunk_lanes(2, tokens, spec)
        res["engine"] = {"lanes": pick, **res[FORMS[pick][0]]}
        return res


def cell(entry: dict | None) -> str:
    """'ms / TFLOPS' of a measure() entry ('-' when absent)."""
    return "-" if entry is None else f"{entry['ms']:.3f} / {entry['tflops']:.0f}"


def form_cells(res: dict | None) -> list[str]:
    """The cells graph 1 lane, graph 2 lanes, engine (lanes) of a measure() result."""
    if res is None:
        return ["-"] * (len(FORMS) + 1)
    eng = res["engine"]
    return [cell(res[key]) for key, _ in FORMS.values()] + [f"{cell(eng)} ({lanes_text(eng)})"]


def lanes_text(entry: dict) -> str:
    """'1 lane' or 'N lanes' of an engine entry."""
    return f"{entry['lanes']} lane" + ("s" if entry["lanes"] > 1 else "")


def form_headers() -> list[str]:
    return [head for _, head in FORMS.values()] + ["engine (lanes)"]


def forms_table(title: str, heads: list[str], rows: list[tuple[list[str], dict, dict]]
                ) -> list[str]:
    """A title line, then 'heads | plain | graph 1 lane | graph 2 lanes | engine (lanes)' and a
    line per (label cells, plain {"ms", "tflops"}, measure() result) in ms / TFLOPS."""
    lines = [title, " | ".join([*heads, "plain ms / TFLOPS", *form_headers()])]
    for labels, plain, res in rows:
        lines.append(" | ".join([*labels, cell(plain), *form_cells(res)]))
    return lines
