"""The host store of a whole model's streamed dense layers: one slot image per layer, which a
DenseCopy op copies into a dense ring slot before the layer's Attention.

Its memory comes from the engine's host context the way the expert store's does
(CudaContext.host_alloc and host_pin, after EngineConfig.store_memory): under "alloc" one
cuMemHostAlloc, page-locked before the first image is written; under "register" ordinary
memory that the images are written into first and that is page-locked once afterwards
(portable and mapped for the device, strata_rt.runtime.host_arena), the faster order for the
several GiB of a large model's layers. Either way a DenseCopy reads a view of the one array the
context handed out, page-locked by the time any copy runs, so each copy is asynchronous and
reads the same host addresses under both settings.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .slots import dense_slot_bytes

if TYPE_CHECKING:
    from ....models.qwen3.weights import Qwen3Model
    from ....models.qwen3.whole_memory import DenseLayout

#: what the host context is told this memory is for (its log and its errors name it)
WHAT = "the streamed dense layers"


class HostMemory(Protocol):
    """The host context's two calls (CudaContext): memory for a named store, and its
    page-locking once the store is filled."""

    def host_alloc(self, nbytes: int, what: str = ...) -> np.ndarray: ...

    def host_pin(self, host: np.ndarray) -> None: ...


class DenseHostStore:
    """The slot images of layers first .. first + len(layout.slots) of `whole`, in
    len(layout.slots) x layout.slot_bytes of memory from `host`: allocated, filled (each
    layer's image at the start of its row; the rest of a row is never read), then page-locked
    once. `rows` [n_layers, slot_bytes] (uint8) is what the fill wrote and the copies read
    (`layer`); `timings` keeps the seconds of each step, as ExpertStore's."""

    def __init__(self, host: HostMemory, whole: Qwen3Model, first: int,
                 layout: DenseLayout) -> None:
        self.n_layers, self.slot_bytes = len(layout.slots), layout.slot_bytes
        self.nbytes = self.n_layers * self.slot_bytes
        t0 = time.perf_counter()
        arena = host.host_alloc(self.nbytes, WHAT)
        if arena.dtype != np.uint8 or arena.size < self.nbytes:
            raise ValueError(f"host_alloc({self.nbytes}) returned {arena.dtype} x {arena.size}")
        self.rows = arena.reshape(-1)[: self.nbytes].reshape(self.n_layers, self.slot_bytes)
        t1 = time.perf_counter()
        for i, slot in enumerate(layout.slots):  # i: the part's own index of the layer
            self.rows[i, : slot.nbytes] = dense_slot_bytes(whole, first + i, slot)
        t2 = time.perf_counter()
        host.host_pin(arena)  # the array as host_alloc returned it: how it finds the arena
        self.timings = {"alloc_s": t1 - t0, "fill_s": t2 - t1,
                        "pin_s": time.perf_counter() - t2}

    def layer(self, i: int, nbytes: int) -> np.ndarray:
        """The first nbytes of the row of the part's layer i: a view, its DenseCopy's source."""
        return self.rows[i, :nbytes]
