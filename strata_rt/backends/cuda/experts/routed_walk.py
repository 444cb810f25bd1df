"""A routed walk on the CUDA backend: its Copy ops switched on the device by RouteCopies.

Inside a captured graph each routed Copy becomes a copy in a conditional node and each
RouteCopies a launch of `route_copies` (kernels/common/copy_switches.cu), which sets the
layer's switches from its expert bounds (runtime/conditional.py says how). Launched plainly,
outside a graph (the driver's first, timed run of a plan), there are no switches: every routed
Copy copies and RouteCopies does nothing, which reads the same bytes, since the plan's
GatherRouted skips the unrouted experts either way. Its own module to keep the executor to
dispatch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ....resources import KERNELS_ROOT
from ....runtime.conditional import CopySwitches, conditional_copies_supported
from ....schedule.plan import Copy, Op, RouteCopies

if TYPE_CHECKING:
    from ....runtime import Graph, Kernel, Runtime, Stream

SWITCH_SOURCE = KERNELS_ROOT / "common" / "copy_switches.cu"
_THREADS = 128


class RoutedWalkCopies:
    """The switches of the routed walk being captured (None outside a capture)."""

    def __init__(self, rt: Runtime, side: Stream):
        self._rt = rt
        self._side = side
        self._kernel: Kernel | None = None
        self.active: CopySwitches | None = None

    @staticmethod
    def supported(can_capture: bool) -> bool:
        """Whether this backend switches routed copies on the device: graphs on, and a driver
        with conditional nodes."""
        return can_capture and conditional_copies_supported()

    def prepare(self, ops: Sequence[Op]) -> None:
        """Before a capture of `ops`: the table for their routed copies (none: nothing)."""
        entries = [op.entry for op in ops if isinstance(op, Copy) and op.routed]
        if not entries:
            return
        if self._kernel is None:
            self._kernel = self._rt.module(SWITCH_SOURCE).kernel("route_copies", "PPPi")
        self.active = CopySwitches(self._rt, max(entries) + 1, self._side)

    def copy(self, op: Copy, stream: Stream, dst: int, src_host: int, nbytes: int) -> bool:
        """A routed Copy as a switched copy while capturing; False: copy it plainly."""
        if self.active is None or not op.routed:
            return False
        self.active.copy(stream, op.entry, dst, src_host, nbytes)
        return True

    def route(self, op: RouteCopies, stream: Stream, bounds: int) -> None:
        """Sets the layer's switches from its bounds (captured), or nothing (plain)."""
        sw = self.active
        if sw is None:
            return
        entries = np.array([k for k, _ in op.copies])
        first, n = int(entries[0]), len(entries)
        if not np.array_equal(entries, np.arange(first, first + n)):
            raise AssertionError(f"{op!r}: a layer's switched copies are consecutive entries")
        for k, e in op.copies:
            sw.set_expert(k, e)
        assert self._kernel is not None
        self._kernel.launch(((n + _THREADS - 1) // _THREADS, 1, 1), (_THREADS, 1, 1), stream,
                            (sw.handles_ptr(first), sw.experts_ptr(first), bounds, n))

    def finish(self, graph: Graph, stream: Stream) -> None:
        """After the capture: the table filled and held by the graph that reads it."""
        if self.active is not None:
            sw, self.active = self.active, None
            sw.upload(stream)
            graph.hold(sw)

    def abandon(self) -> None:
        """A capture that failed: its table goes."""
        if self.active is not None:
            self.active.free()
            self.active = None
