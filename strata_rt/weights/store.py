"""ExpertStore: every expert blob of every layer in one host arena.

One allocation (page-locked on the CUDA backend, so copies to the ring run at full PCIe speed)
with each blob at a SLOT_ALIGN-aligned offset: a ring slot and a store entry have the same size,
and a copy is one contiguous range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .model import Model

HostAlloc = Callable[[int], np.ndarray]


def numpy_alloc(nbytes: int) -> np.ndarray:
    """The reference backend's host memory: plain pageable numpy."""
    return np.empty(nbytes, dtype=np.uint8)


class ExpertStore:
    def __init__(self, model: Model, host_alloc: HostAlloc = numpy_alloc):
        spec = model.spec
        self.layout = model.layout
        self.formats = model.formats
        self.slot_bytes = self.layout.slot_bytes
        self.n_layers, self.n_experts = spec.n_layers, spec.n_experts
        self.nbytes = spec.n_layers * spec.n_experts * self.slot_bytes
        arena = host_alloc(self.nbytes)
        if arena.dtype != np.uint8 or arena.size < self.nbytes:
            raise ValueError(f"host_alloc({self.nbytes}) returned {arena.dtype} x {arena.size}")
        self.arena = arena.reshape(-1)[: self.nbytes]
        grid = self.arena.reshape(spec.n_layers, spec.n_experts, self.slot_bytes)
        for layer, lay in enumerate(self.formats.layouts):
            grid[layer, :, lay.blob_bytes:] = 0  # padding: fixed bytes, runs compare with cmp
        # layer by layer from wherever the model keeps its experts (a GGUF file's memory map:
        # no second copy of the experts is ever held)
        model.write_layers(grid)

    def offset(self, layer: int, e: int) -> int:
        if not (0 <= layer < self.n_layers and 0 <= e < self.n_experts):
            raise IndexError(f"layer {layer} expert {e} outside the store "
                             f"({self.n_layers} layers x {self.n_experts} experts)")
        return (layer * self.n_experts + e) * self.slot_bytes

    def view(self, layer: int, e: int) -> np.ndarray:
        """The blob (without padding) of one expert."""
        o = self.offset(layer, e)
        return self.arena[o: o + self.formats.layout(layer).blob_bytes]
