"""The CUDA executor's ops that move expert blobs and order its streams: a Copy of a blob from
the host store into a ring slot (a routed walk's as a switched copy while it is captured:
experts.routed_walk), Record and Wait of plan events (a split's hand-off events through its
PartLink), and the gathers of group images (Gather, GatherBatch; GatherRouted, which reads the
routed experts where they lie, the host store's over PCIe). Its own module so the executor
keeps to the chunk's state and dispatch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...schedule.plan import (
    HANDOFF_EVENTS,
    HOST,
    RESIDENT,
    Copy,
    Gather,
    GatherBatch,
    GatherRouted,
    Record,
    Wait,
)
from .backend_view import ExpertsView

if TYPE_CHECKING:
    from ...report.timing import PhaseTimer
    from ...runtime import Stream
    from ...weights.model import Model
    from ...weights.store import ExpertStore
    from .experts.routed_walk import RoutedWalkCopies
    from .split_part import PartLink


class RingHost(ExpertsView, Protocol):
    """What these ops read of the backend that runs them (executor.CudaBackend), besides
    what every expert op reads."""

    @property
    def model(self) -> Model: ...
    @property
    def store(self) -> ExpertStore: ...
    @property
    def walk_copies(self) -> RoutedWalkCopies: ...
    @property
    def _timer(self) -> PhaseTimer | None: ...
    @property
    def _link(self) -> PartLink | None: ...
    def _lane(self, op: Gather | GatherBatch | GatherRouted) -> tuple[Stream, int, int]: ...
    def _bounds_ptr(self, layer: int) -> int: ...
    def store_device_address(self) -> int: ...


def ring_ops(b: RingHost) -> dict[type, Callable[[Any], None]]:
    """The executor's dispatch of these ops."""
    return {Copy: lambda op: copy(b, op), Record: lambda op: record(b, op),
            Wait: lambda op: wait(b, op), Gather: lambda op: gather(b, op),
            GatherBatch: lambda op: gather_batch(b, op),
            GatherRouted: lambda op: gather_routed(b, op)}


def source(b: RingHost, g: Gather) -> int:
    """The device address a Gather reads its blob at (a resident or a ring slot)."""
    kind, idx = g.src
    base = b._device().ptr["resident" if kind == RESIDENT else "ring"]
    return base + idx * b.lay.slot_bytes


def copy(b: RingHost, op: Copy) -> None:
    dev, timer = b._device(), b._timer
    off = b.store.offset(op.layer, op.expert)
    if timer is not None:
        timer.copy_begin(f"copy L{op.layer} E{op.expert} -> slot {op.slot}")
    nbytes = b.model.formats.layout(op.layer).blob_bytes
    dst, src = dev.ptr["ring"] + op.slot * b.lay.slot_bytes, b.store.arena[off:]
    if not b.walk_copies.copy(op, (s := dev.streams[op.stream]), dst, src.ctypes.data, nbytes):
        b.rt.memcpy_htod(dst, src[:nbytes], s)
    if timer is not None:
        timer.copy_end()


def record(b: RingHost, op: Record) -> None:
    if b._link is not None and op.event[0] in HANDOFF_EVENTS:
        return b._link.record(op)
    dev = b._device()
    dev.event(op.event).record(dev.streams[op.stream])


def wait(b: RingHost, op: Wait) -> None:
    if b._link is not None and op.event[0] in HANDOFF_EVENTS:
        return b._link.wait(op)
    if op.stream == "compute":
        b._mark("wait copy")
    dev = b._device()
    dev.streams[op.stream].wait(dev.event(op.event))


def gather(b: RingHost, op: Gather) -> None:
    s, gu, dn = b._lane(op)
    b._mark("gather")
    b.fks[op.layer].gather(s, source(b, op), op.pos, gu, dn)


def gather_batch(b: RingHost, op: GatherBatch) -> None:
    s, gu, dn = b._lane(op)
    b._mark("gather")
    b.fks[op.gathers[0].layer].gather_batch(s, [source(b, g) for g in op.gathers],
                                            op.first_pos, gu, dn)


def gather_routed(b: RingHost, op: GatherRouted) -> None:
    base = b.store_device_address() if any(g.src[0] == HOST for g in op.gathers) else 0
    srcs = [base + b.store.offset(g.layer, g.expert) if g.src[0] == HOST else source(b, g)
            for g in op.gathers]
    first = op.gathers[0]
    s, gu, dn = b._lane(op)
    b._mark("gather")
    b.fks[first.layer].gather_routed(s, srcs, gu, dn, b._bounds_ptr(first.layer), first.expert)
