"""The CUDA executor as one part of a layer split (strata_rt.schedule.split): what its
plans' hand-off ops do on the device, and the layers it holds.

Events. A hand-off event lives in the context of the part that records it: handoff_ready(b)
on the sender (recorded after its last LayerEnd), handoff_taken(b) on the receiver (after its
copy). The other part's compute stream waits on it there: cuStreamWaitEvent takes an event of
another context (another device too), while cuEventRecord needs the event and the stream in
one context. A sender's first wait on handoff_taken finds no record, since nothing was handed
off yet, and is skipped (what CUDA does for an event never recorded, made explicit, as
runtime.streams refuses such waits everywhere else).

The copy. HandOff is the receiver's: on its compute stream, the sender's residual `x` into its
own and the chunk's position register, by Runtime.memcpy_peer (one context: a device copy;
two: cuMemcpyPeerAsync).

Graphs. A wait on an event recorded outside a capture cannot be captured as a plain wait, so a
split part captures its plan without the hand-off ops and runs them live around each replay:
the waits, the copy and the taken record before the graph, the ready record after it. Moving
a wait earlier and a record later only adds order; the ops left in the graph before the
hand-off touch neither the residual nor the position (copies, dense copies).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import PlanHazardError, StrataError
from ...models.qwen3.whole_memory import DenseTypes
from ...schedule.plan import HANDOFF_EVENTS, HANDOFF_READY, HANDOFF_TAKEN, HandOff, Op, Record, Wait
from .backend_view import BackendView

if TYPE_CHECKING:
    from ...models.qwen3.spec import Qwen3Spec
    from ...runtime import Graph, Stream
    from ...schedule.split import Part
    from ...weights.model import MoESpec
    from .whole import CudaWhole


def part_moe_spec(spec: MoESpec, part: Part) -> MoESpec:
    """The MoE shape of a part's own layers: what its memory plan, ring and resident count are
    sized for (every per-layer region holds its layers only)."""
    return replace(spec, n_layers=part.end - part.first)


def part_whole(spec: Qwen3Spec, types: DenseTypes, part: Part) -> tuple[Qwen3Spec, DenseTypes]:
    """A whole model's dimensions and dense types for a part's own layers (its dense slots
    and KV cache hold those only; the head's and the embedding's types stay)."""
    return (replace(spec, n_layers=part.end - part.first),
            replace(types, layers=types.layers[part.first: part.end]))


def is_handoff(op: Op) -> bool:
    """Whether an op orders or moves a split's hand-off (run live around a captured plan)."""
    if isinstance(op, HandOff):
        return True
    return isinstance(op, Record | Wait) and op.event[0] in HANDOFF_EVENTS


def split_for_capture(ops: Iterable[Op]) -> tuple[list[Op], list[Op], list[Op]]:
    """(before, body, after): the plan's hand-off ops that run live before a replay (waits,
    the copy, the taken record), the ops captured, the ready records that run after it."""
    before: list[Op] = []
    body: list[Op] = []
    after: list[Op] = []
    for op in ops:
        if not is_handoff(op):
            body.append(op)
        elif isinstance(op, Record) and op.event[0] == HANDOFF_READY:
            after.append(op)
        else:
            before.append(op)
    return before, body, after


@dataclass
class PartReplay:
    """A split part's captured plan: its hand-off ops run live around the graph."""

    graph: Graph
    before: list[Op]
    after: list[Op]
    run_live: Callable[[list[Op]], None]

    def launch(self, stream: Stream) -> None:
        self.run_live(self.before)
        self.graph.launch(stream)
        self.run_live(self.after)

    def free(self) -> None:
        self.graph.free()


class LinkedPart(BackendView, Protocol):
    """What a hand-off reads of a split part's backend (executor.CudaBackend), besides the
    shared view."""

    @property
    def part(self) -> Part: ...
    @property
    def peers(self) -> Sequence[LinkedPart]: ...
    @property
    def _whole(self) -> CudaWhole | None: ...


class PartLink:
    """The hand-off ops of one part: its backend, and through `peers` (every part's backend
    by part index, set when the split opens) the others'."""

    def __init__(self, backend: LinkedPart):
        self.backend = backend

    def _peer(self, index: int) -> LinkedPart:
        peers = self.backend.peers
        if not 0 <= index < len(peers):
            raise StrataError(f"part {index} of the split is not open here (parts: "
                              f"{len(peers)})")
        return peers[index]

    def _owner(self, key: tuple[str, int]) -> LinkedPart:
        """The part whose context holds hand-off event `key` (the part that records it)."""
        kind, boundary = key
        for b in self.backend.peers:
            if (b.part.end if kind == HANDOFF_READY else b.part.first) == boundary:
                return b
        raise PlanHazardError(f"hand-off event {key} names boundary {boundary}, which no "
                              "part of the split ends or starts at")

    def record(self, op: Record) -> None:
        dev = self.backend._device()
        if self._owner(op.event) is not self.backend:
            raise PlanHazardError(f"{op!r}: part {self.backend.part.index} records a hand-off "
                                  "event another part owns")
        dev.event(op.event).record(dev.streams[op.stream])

    def wait(self, op: Wait) -> None:
        owner = self._owner(op.event)
        ev = owner._device().find_event(op.event)
        if ev is None or not ev.recorded:
            if op.event[0] == HANDOFF_TAKEN:
                return  # nothing handed off yet: no copy can still be reading the residual
            raise PlanHazardError(f"{op!r}: part {self.backend.part.index} waits for the "
                                  f"residual of part {owner.part.index}, which did not "
                                  "record it yet")
        dev = self.backend._device()
        dev.streams[op.stream].wait(ev)

    def handoff(self, op: HandOff) -> None:
        """The sender's residual and position into this part's, on its compute stream."""
        me = self.backend
        if self._peer(op.dst) is not me:
            raise StrataError(f"{op!r}: this executor is part {me.part.index}")
        sender = self._peer(op.src)
        if sender._T != me._T:
            raise StrataError(f"{op!r}: the sender holds {sender._T} rows, this chunk {me._T}")
        dev, src = me._device(), sender._device()
        me.rt.memcpy_peer(dev.ptr["x"], src.ptr["x"], sender.rt,
                          me._T * me.spec.hidden * 4, dev.compute)
        if me._whole is not None:
            if sender._whole is None:
                raise StrataError(f"{op!r}: the sender runs MoE layers alone")
            me._whole.receive_position(sender._whole, dev.compute)


def run_ops(backend: Any, ops: list[Op]) -> None:
    """The live half of a PartReplay: the ops through the backend's own dispatch."""
    if ops:
        from ...report.stats import Stats

        backend.execute(ops, Stats(), None)


def capture_plan(backend: Any, ops: Iterable[Op], linked: bool) -> Graph | PartReplay:
    """The CUDA executor's capture of `ops` as one graph on its compute stream (every other
    stream joined in); a split part's (`linked`) hand-off ops are left out of it and run live
    around each replay (the module doc)."""
    from ...report.stats import Stats

    dev = backend._device()
    before: list[Op] = []
    after: list[Op] = []
    ops = list(ops)
    if linked:
        before, ops, after = split_for_capture(ops)
    backend.walk_copies.prepare(ops)  # a routed walk's switch table, allocated before
    try:
        with backend.rt.capture(dev.compute) as graph, dev.joined():
            backend.execute(ops, Stats(), None)
    except BaseException:
        backend.walk_copies.abandon()
        raise
    backend.walk_copies.finish(graph, dev.compute)
    graph.upload(dev.compute)  # now, not inside the first replay the driver times
    dev.compute.synchronize()
    if before or after:
        return PartReplay(graph, before, after, partial(run_ops, backend))
    return graph
