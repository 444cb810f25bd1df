"""ExpertStore: every expert blob of every layer in one host arena.

One allocation (page-locked on the CUDA backend, so copies to the ring run at full PCIe speed)
with each blob at a SLOT_ALIGN-aligned offset: a ring slot and a store entry have the same size,
and a copy is one contiguous range.

The arena is filled first and pinned after (`host_pin`): the CUDA backend hands out ordinary
memory whose pages the fill's threads allocate as they write, then page-locks what is already
there (strata_rt.runtime.host_arena says why that order is the fast one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .model import Model

HostAlloc = Callable[[int], np.ndarray]
HostPin = Callable[[np.ndarray], None]


def numpy_alloc(nbytes: int) -> np.ndarray:
    """The reference backend's host memory: plain pageable numpy."""
    return np.empty(nbytes, dtype=np.uint8)


class ExpertStore:
    def __init__(self, model: Model, host_alloc: HostAlloc = numpy_alloc,
                 host_pin: HostPin | None = None):
        """Allocates the arena (`host_alloc`), writes every layer's blobs into it, then hands
        it to `host_pin` (once, filled; None: nothing to pin). `timings` keeps the seconds of
        each step (bench/bench_open_store.py reads them)."""
        spec = model.spec
        self.layout = model.layout
        self.formats = model.formats
        self.slot_bytes = self.layout.slot_bytes
        self.n_layers, self.n_experts = spec.n_layers, spec.n_experts
        self.nbytes = spec.n_layers * spec.n_experts * self.slot_bytes
        t0 = time.perf_counter()
        arena = host_alloc(self.nbytes)
        if arena.dtype != np.uint8 or arena.size < self.nbytes:
            raise ValueError(f"host_alloc({self.nbytes}) returned {arena.dtype} x {arena.size}")
        self.arena = arena.reshape(-1)[: self.nbytes]
        grid = self.arena.reshape(spec.n_layers, spec.n_experts, self.slot_bytes)
        t1 = time.perf_counter()
        # layer by layer from wherever the model keeps its experts (a GGUF file's memory map:
        # no second copy of the experts is ever held), on several threads
        model.write_layers(grid)
        for layer, lay in enumerate(self.formats.layouts):
            # padding: fixed bytes, runs compare with cmp (written after the blobs, so that
            # the first write of every page is the fill's)
            grid[layer, :, lay.blob_bytes:] = 0
        t2 = time.perf_counter()
        if host_pin is not None:
            host_pin(self.arena)
        self.timings = {"alloc_s": t1 - t0, "fill_s": t2 - t1,
                        "pin_s": time.perf_counter() - t2}

    def offset(self, layer: int, e: int) -> int:
        if not (0 <= layer < self.n_layers and 0 <= e < self.n_experts):
            raise IndexError(f"layer {layer} expert {e} outside the store "
                             f"({self.n_layers} layers x {self.n_experts} experts)")
        return (layer * self.n_experts + e) * self.slot_bytes

    def view(self, layer: int, e: int) -> np.ndarray:
        """The blob (without padding) of one expert."""
        o = self.offset(layer, e)
        return self.arena[o: o + self.formats.layout(layer).blob_bytes]
