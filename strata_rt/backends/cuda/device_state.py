"""Every CUDA object one CUDA engine holds, in one place: streams, events, the device arena
and its region addresses, the pinned staging buffers. `close` drops them all at once, while
the runtime's context still lives (the runtime frees what it allocated when it closes), so no
list of attribute names has to be kept in step with the code that creates them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ...schedule.plan import COPY_CHAINS, LANES
from ...schedule.vram.memory_plan import lane_buffers
from .chunk_input import InputPass
from .experts.table_rows import TableRows

if TYPE_CHECKING:
    from ...formats.contract import ExpertLayout, FormatKernels
    from ...runtime import Event, Runtime, Stream
    from ...schedule.vram.image_cache import ImageCache
    from ...schedule.vram.residency import Residency
    from ...weights.model import MoESpec


class DeviceState:
    def __init__(self, rt: Runtime, regions: dict[str, int], budget: int, io_bytes: int,
                 bounds_shape: tuple[int, int], lanes: int = 1, max_tokens: int = 1,
                 copy_chains: int = 1):
        self.compute = rt.stream("compute")
        self.copy = rt.stream("copy")
        #: routed-set read-backs go on their own stream, never behind the copies of blobs
        self.readback = rt.stream("readback")
        self.streams: dict[str, Stream] = {"compute": self.compute, "copy": self.copy}
        for lane in LANES[1:lanes]:  # the other compute lanes (strata_rt.schedule.vram.lanes)
            self.streams[lane] = rt.stream(lane)
        for chain in COPY_CHAINS[1:copy_chains]:  # a routed walk's other copy streams
            self.streams[chain] = rt.stream(chain)
        self.arena = rt.device_arena(regions, budget=budget)
        self.ptr: dict[str, int] = {name: self.arena.ptr(name) for name in regions}
        #: each compute lane's stream and group buffers (gate/up, down), looked up once
        self.lanes: dict[str, tuple[Stream, int, int]] = {}
        for lane in LANES[:lanes]:
            gate_up, down = lane_buffers(lane)
            self.lanes[lane] = (self.streams[lane], self.ptr[gate_up], self.ptr[down])
        n_bounds = bounds_shape[0] * bounds_shape[1]
        self.host = rt.pinned({"io": io_bytes, "bounds": n_bounds * 4, "gate": 4,
                               "nonfinite": 8, "ids": max(1, max_tokens) * 4})
        self.io = self.host.view("io", np.float32)
        #: the chunk's input: the host pass into `io` (or, for a whole model's token ids,
        #: `ids`), and the gate the upload waits at
        self.input = InputPass(rt.gate(self.host.view("gate", np.uint32)), self.compute,
                               self.io, self.host.view("ids", np.int32))
        self.bounds_host = self.host.view("bounds", np.int32).reshape(bounds_shape)
        #: the RMSNorm's flag word, read back after each chunk (all ones: every row finite)
        self.nonfinite_host = self.host.view("nonfinite", np.uint64)
        self.routed = rt.event("routed")
        self.fork = rt.event("walk fork")
        self.join = rt.event("walk join")
        #: the rows of the products table (a LayerProducts' blob addresses) written so far
        self.products_rows = TableRows()
        self._rt = rt
        self._events: dict[tuple[str, int], Event] = {}
        self._routing_into: np.ndarray | None = None

    def routing_readback(self, into: np.ndarray) -> None:
        """Enqueues the copy of every layer's row bounds into pinned memory on the compute
        stream; `add_routing`, once that stream has been waited for, adds their counts to
        `into` (the layers' rows of a routing_counts array). A chunk therefore waits once for
        its routing and its output together."""
        self._rt.memcpy_dtoh(self.bounds_host, self.ptr["bounds"], self.compute)
        self._routing_into = into

    def add_routing(self) -> None:
        """After the wait: the counts routing_readback asked for (nothing when none)."""
        into, self._routing_into = self._routing_into, None
        if into is not None:
            into += np.diff(self.bounds_host, axis=1)

    def event(self, key: tuple[str, int]) -> Event:
        """The plan event `key` (created on first use, then reused by every chunk)."""
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self._rt.event(f"{key[0]}[{key[1]}]")
        return ev

    def find_event(self, key: tuple[str, int]) -> Event | None:
        """The plan event `key` if this device created it (a split's hand-off events live on
        the device that records them; another part's stream waits on them there)."""
        return self._events.get(key)

    @contextmanager
    def joined(self) -> Iterator[None]:
        """Every other stream waits for the compute stream's work so far on entry, and the
        compute stream for theirs on exit: what a graph capture on the compute stream needs
        to take in the copies and the other lane (a stream must join a capture through an
        event recorded inside it before its work is captured, and rejoin before it ends)."""
        others = [s for s in self.streams.values() if s is not self.compute]
        self.fork.record(self.compute)
        for s in others:
            s.wait(self.fork)
        yield
        for s in others:
            self.join.record(s)
            self.compute.wait(self.join)

    def close(self) -> None:
        self.__dict__.clear()

    def fill_images(self, images: ImageCache, spec: MoESpec, residency: Residency,
                    fks: list[FormatKernels], lay: ExpertLayout) -> None:
        """Each cached group's images, written by its layer's own gather from the resident
        slots into the group's block (the bytes a per-chunk gather would write)."""
        from ...schedule.vram.image_cache import block_bytes

        gu, dn = block_bytes(lay)
        for b, pos, slot in images.fills(spec, residency):
            layer = residency.pairs[slot][0]
            fks[layer].gather(self.compute, self.ptr["resident"] + slot * lay.slot_bytes, pos,
                              self.ptr["image_gate_up"] + b * gu, self.ptr["image_down"] + b * dn)
        self.compute.synchronize()

