"""Counters every prefill returns (always on: they cost an integer add each).

Backends add to one Stats per prompt. Besides the counters they call `stats.layer_done(layer)`
after each layer (the engine turns it into progress reports) and, when `routing_counts` is not
None (`engine.prefill(h, record_routing=True)`), add each layer's top-k hits to
`routing_counts[layer]`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Stats:
    tokens: int = 0
    chunks: int = 0
    experts_streamed: int = 0
    bytes_streamed: int = 0
    gathers_launched: int = 0
    mmq_launches: int = 0
    host_syncs: int = 0
    #: how the prompt's chunks ran: "chunks" (each through every layer in turn) or "layers"
    #: (the layer pass, schedule.planners.layer_pass)
    prefill_order: str = "chunks"
    #: wall time of the prefill call and the host time spent issuing work, seconds
    wall_s: float = 0.0
    host_s: float = 0.0
    #: seconds per phase (backend-specific phase names, see strata_rt.report.timing.PHASES)
    phase_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: int64 [n_layers, n_experts] top-k hits, when asked for
    routing_counts: np.ndarray | None = None
    #: STRATA_PREFILL_TIMING: the phase table of the prompt (None when timing is off)
    phase_table: str | None = None
    #: STRATA_PREFILL_TIMING on the CUDA backend: the prompt's compute and copy stream spans
    #: (Chrome/Perfetto complete events; timing.write_trace writes them)
    trace: list[dict[str, Any]] | None = field(default=None, repr=False)
    #: called as on_layer(chunk, n_chunks, layer, n_layers); set by the engine
    on_layer: Callable[[int, int, int, int], None] | None = field(default=None, repr=False)
    chunk_index: int = field(default=0, repr=False)
    n_chunks: int = field(default=1, repr=False)
    n_layers: int = field(default=0, repr=False)

    def layer_done(self, layer: int) -> None:
        if self.on_layer is not None:
            self.on_layer(self.chunk_index, self.n_chunks, layer, self.n_layers)

    def add_routing(self, layer: int, ids: np.ndarray, n_experts: int) -> None:
        if self.routing_counts is not None:
            self.routing_counts[layer] += np.bincount(np.asarray(ids).reshape(-1),
                                                      minlength=n_experts)

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "tokens", "chunks", "experts_streamed", "bytes_streamed", "gathers_launched",
            "mmq_launches", "host_syncs", "prefill_order", "wall_s", "host_s")}
        d["phase_s"] = dict(self.phase_s)
        if self.routing_counts is not None:
            d["routing_counts"] = self.routing_counts.tolist()
        return d
