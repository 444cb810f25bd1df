"""The hazard checker: replays a Plan under CUDA's stream and event rules.

Model: ops run in host issue order; each copy stream (plan.COPY_CHAINS) and each compute lane
(plan.LANES) executes its ops in order; Record(event) snapshots its stream's progress and
Wait(event) makes a stream wait for the latest Record of that event issued before the Wait
(CUDA semantics: waiting on an event never recorded does not wait at all, an error here).
Vector clocks of one component per stream order ops across streams: op a happens before op b
iff b's clock has caught up with a's own-stream component. The rules ask for an order, not
for the event a planner uses to get it.

Rejected (each message names the ring slot or the layer, the entry/expert, the lane and the ops
with their index in the chunk's op list):
- a Copy refilling a slot a gather of the previous occupant may read; a gather reading a slot
  whose copy of its entry is not before it, never issued or overwritten; a Wait on an event
  never recorded; a Record or Wait off the copy streams and the lanes;
- a gather or Products off the compute lanes, a batch member naming another lane than its
  launch; a Consume passing an entry a not-yet-launched gather still reads; a Copy issued
  while its entry >= consumed + ring, and a wait cycle (entry k needed before Copy(k));
- an op reading the hidden states ahead of the chunk's ChunkInput, a second ChunkInput, one of
  an unknown kind, or of token ids where a layer opens without its Attention (no embedding);
- (a layer pass) rows switched inside a layer, a chunk's layers out of order or skipped, an
  Attention before its earlier rows' keys, chunks not covering the prompt (hazards.rows);
- Products reading a group-buffer position of its lane that does not hold the expert it names
  (each lane has its own set), image-cache blocks or resident slots that do not hold its
  experts, a LayerProducts whose parts do not cover its layer once, a RoutedExperts whose
  sources are not where its experts lie, or either beside other products of its layer
  (strata_rt.schedule.hazards.sources);
- an op off the first lane reading its layer's routing before its LayerBegin (no lane_fork
  waited on) or with none; a LayerEnd combining rows another lane may still write (no
  lane_join waited on); a Products after its layer's LayerEnd; a hand-off op fed to one
  device's checker alone (schedule/split/hazards.py);
- (a routed walk) a routed Copy not after the RouteCopies that switched it, a plain gather
  reading a routed copy's slot (hazards.routed_copies); (streamed dense weights) a DenseCopy
  refilling a slot an Attention may still read, an Attention whose slot does not hold its
  layer copied before it (hazards.dense).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Protocol

from ...errors import PlanHazardError
from ..plan import (
    COPY_CHAINS,
    HANDOFF_EVENTS,
    HOST,
    INPUT_KINDS,
    LANE_FORK,
    LANE_JOIN,
    LANES,
    RESIDENT,
    RING,
    Attention,
    ChunkInput,
    Consume,
    Copy,
    DenseCopy,
    Gather,
    GatherBatch,
    GatherRouted,
    HandOff,
    LayerBegin,
    LayerEnd,
    LayerProducts,
    Op,
    Products,
    PromptRows,
    Record,
    RouteCopies,
    RoutedExperts,
    Wait,
)
from .dense import DenseRing
from .messages import Clock, Occupant, describe, event_subject
from .routed_copies import CopySwitches
from .rows import PromptWindows
from .sources import Multiplied, elsewhere_hint, products_problem

if TYPE_CHECKING:
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency

#: the streams a clock has a component for: the copy streams, then the compute lanes
_STREAMS: tuple[str, ...] = (*COPY_CHAINS, *LANES)
_COMPONENT = {stream: n for n, stream in enumerate(_STREAMS)}
#: the lane of a layer's routing and combine (LayerBegin, LayerEnd, the whole-model ops)
_MAIN = LANES[0]
#: what a group-buffer position holds: (layer, group, expert, op index of its gather)
Held = tuple[int, int, int, int]


class HandOffLink(Protocol):
    """What a part's Checker hands its cross-device ops to (split.hazards.SplitChecker)."""

    def op(self, checker: Checker, i: int, op: Record | Wait | HandOff) -> None: ...

    def overwrites(self, checker: Checker, i: int, what: str) -> None: ...


class Checker:
    """Incremental checker: feed the layer plans of one chunk in order (the staging ring plans
    a layer at a time and is checked before each layer runs). `input_arrived`: check ops
    that follow a chunk's ChunkInput elsewhere (a layer checked on its own)."""

    def __init__(self, ring_slots: int, residency: Residency | None = None,
                 images: ImageCache | None = None, input_arrived: bool = False,
                 link: HandOffLink | None = None):
        self.ring = ring_slots
        self.link = link  # the split checker that takes a split part's hand-off ops
        self.wrote = 0    # the main lane's own clock at the last op writing the residual
        self.residency = residency
        self.images = images
        self.clock = {stream: [0] * len(_STREAMS) for stream in _STREAMS}
        self.events: dict[tuple[str, int], tuple[Clock, int]] = {}
        self.slots: dict[int, Occupant] = {}
        self.copies: dict[int, int] = {}          # entry -> op index of its Copy
        self.consumed = 0                         # entries released (count)
        self.consume_op = -1
        #: lane -> its group buffers: pos -> what the position holds
        self.buffers: dict[str, dict[int, Held]] = {lane: {} for lane in LANES}
        self.n = 0                                 # ops seen
        #: the rows the ops act on and each chunk's input (hazards.rows); the input's kind
        #: (None: unknown), and the layers whose Attention ran (a whole model's)
        self.rows = PromptWindows(input_arrived)
        self.input_kind: str | None = None
        self.attended: set[int] = set()
        #: layer -> (clock, op index) of its LayerBegin, and of its LayerEnd once combined
        self.begun: dict[int, tuple[Clock, int]] = {}
        self.ended: dict[int, int] = {}
        #: layer -> (clock, op index, op) of its Products not yet combined
        self.multiplied: dict[int, Multiplied] = {}
        #: the dense ring slots of streamed dense weights (hazards.dense)
        self.dense = DenseRing(self._before)
        self.switches = CopySwitches(self._before)  # a routed walk's copies

    # ------------------------------------------------------------------ helpers
    def _fail(self, msg: str) -> NoReturn:
        raise PlanHazardError(msg)

    def _check(self, problem: str | None) -> None:
        if problem is not None:
            self._fail(problem)

    def _tick(self, stream: str) -> Clock:
        c = self.clock[stream]
        c[_COMPONENT[stream]] += 1
        return tuple(c)

    @staticmethod
    def _before(clock_a: Clock, stream_a: str, clock_b: Clock) -> bool:
        i = _COMPONENT[stream_a]
        return clock_a[i] <= clock_b[i]

    # ------------------------------------------------------------------ feeding
    def feed(self, ops: tuple[Op, ...] | list[Op]) -> None:
        base = self.n
        readers: dict[int, int] = {}   # ring entry -> op index of the launch reading it
        for j, op in enumerate(ops):
            for g in (op.gathers if isinstance(op, GatherBatch) else
                      (op,) if isinstance(op, Gather) else ()):
                if g.src[0] == RING and g.entry is not None:
                    readers.setdefault(g.entry, base + j)
        for j, op in enumerate(ops):
            self._op(base + j, op, readers)
        self.n = base + len(ops)

    def _op(self, i: int, op: Op, readers: dict[int, int]) -> None:
        if isinstance(op, HandOff) or (isinstance(op, Record | Wait)
                                       and op.event[0] in HANDOFF_EVENTS):
            if self.link is None:
                self._fail(f"op #{i} {describe(op)}: a layer split's hand-off orders two "
                           "devices' plans; check them together (schedule.split.hazards)")
            self.link.op(self, i, op)
        elif isinstance(op, Copy):
            self._copy(i, op)
        elif isinstance(op, Record):
            self._stream_of(i, op)
            self.events[op.event] = (self._tick(op.stream), i)
        elif isinstance(op, Wait):
            self._stream_of(i, op)
            rec = self.events.get(op.event)
            if rec is None:
                self._fail(f"{event_subject(op.event)}: op #{i} {describe(op)} waits on an "
                           f"event that was never recorded (CUDA would not wait at all)")
            c = self.clock[op.stream]
            c[:] = [max(mine, theirs) for mine, theirs in zip(c, rec[0])]
            self._tick(op.stream)
        elif isinstance(op, Gather):
            now = self._launch(i, op)
            self._gather(i, op, now, f"op #{i} {describe(op)}", describe(op))
        elif isinstance(op, GatherBatch | GatherRouted):
            now = self._launch(i, op)
            first = op.first_pos if isinstance(op, GatherBatch) else 0
            routed = isinstance(op, GatherRouted)
            for n, g in enumerate(op.gathers):
                self._member(i, op, n, g, first + n)
                if isinstance(op, GatherRouted):  # it skips experts routed no rows
                    self._reads_routing(i, op, g.layer, now)
                self._gather(i, g, now, f"op #{i} {describe(op)} member {describe(g)}",
                             f"{describe(g)} in {describe(op)}", host_ok=routed)
        elif isinstance(op, Products | LayerProducts | RoutedExperts):
            self._products(i, op, self._launch(i, op))
        elif isinstance(op, Consume):
            self._consume(i, op, readers)
        elif isinstance(op, DenseCopy):
            self._check(self.dense.copy(i, op, self._tick("copy")))
        elif isinstance(op, RouteCopies):
            self._check(self.switches.route(i, op, self._tick(op.stream), self.begun))
        elif isinstance(op, PromptRows):
            self._check(self.rows.switch(i, op, [n for n in self.begun if n not in self.ended]))
            self.begun, self.ended = {}, {}  # the next chunk routes and combines anew
            self._tick(op.stream)
        elif isinstance(op, ChunkInput):
            if op.kind not in INPUT_KINDS:
                self._fail(f"op #{i} {op!r}: kind must be one of {', '.join(INPUT_KINDS)}")
            self.arrive(i, "ChunkInput")
            self.input_kind = op.kind
            self._tick(op.stream)
        elif isinstance(op, Attention):
            self._needs_input(i, op)
            self._check(self.rows.enter(i, op) or self.rows.attention(i, op))
            self._check(self.dense.read(i, op, self._tick(op.stream)))
            self.attended.add(op.layer)
            self.wrote = self.clock[_MAIN][_COMPONENT[_MAIN]]
        elif isinstance(op, LayerBegin):
            self._needs_input(i, op)
            if self.input_kind == "tokens" and op.layer not in self.attended:
                self._fail(f"op #{i} {describe(op)} routes the embedding rows of the chunk's "
                           "token ids with no Attention of its layer before it: a ChunkInput "
                           "of token ids needs a whole model (MoE layers alone have no "
                           "embedding)")
            self._check(self.rows.enter(i, op))
            self.begun[op.layer] = (self._tick(op.stream), i)
        elif isinstance(op, LayerEnd):
            self._combine(i, op, self._tick(op.stream))
            self.rows.combined(op)
            self.wrote = self.clock[_MAIN][_COMPONENT[_MAIN]]
        else:  # Logits: compute work that touches no ring slot
            self._tick(op.stream)

    def arrive(self, i: int, what: str) -> None:
        """The chunk's hidden states reach the device at op #i (ChunkInput or a HandOff),
        overwriting the residual (a split's link checks no receiver may still copy it)."""
        self._check(self.rows.arrive(i, what))
        if self.link is not None:
            self.link.overwrites(self, i, what)

    def tick(self, stream: str) -> Clock:  # a hand-off op the split checker ordered
        return self._tick(stream)

    def _needs_input(self, i: int, op: LayerBegin | Attention) -> None:
        if not self.rows.has_input():
            self._fail(f"op #{i} {describe(op)} reads the chunk's hidden states, but no "
                       "ChunkInput before it brought them to the device")

    def _stream_of(self, i: int, op: Record | Wait) -> None:
        if op.stream not in _COMPONENT:
            self._fail(f"op #{i} {describe(op)}: stream must be one of {', '.join(_STREAMS)} "
                       "(an event orders GPU streams; host bookkeeping runs on none)")

    def _launch(self, i: int, op: Gather | GatherBatch | GatherRouted | Products
                | LayerProducts | RoutedExperts) -> Clock:
        """Ticks the lane the launch names, which must be a compute lane."""
        if op.stream not in LANES:
            self._fail(f"op #{i} {describe(op)}: gathers and products run on a compute "
                       f"lane ({', '.join(LANES)}), not on {op.stream}")
        return self._tick(op.stream)

    def _member(self, i: int, op: GatherBatch | GatherRouted, n: int, g: Gather,
                pos: int) -> None:
        """A launch's member n must name the launch's group, position `pos` and lane."""
        if g.group != op.group or g.pos != pos:
            self._fail(f"op #{i} {describe(op)}: member {n} is {describe(g)}, not "
                       f"group {op.group} position {pos}")
        if g.stream != op.stream:
            self._fail(f"op #{i} {describe(op)}: member {n} {describe(g)} names lane "
                       f"{g.stream}, not the launch's {op.stream}: one launch fills one "
                       "lane's group buffers, so every member must name that lane")

    def _reads_routing(self, i: int, op: GatherRouted | Products | LayerProducts
                       | RoutedExperts, layer: int, now: Clock) -> None:
        """An op reading layer `layer`'s routing (bounds, quantized activations) off the main
        lane must be ordered after the layer's LayerBegin (on the main lane it is, by stream
        order; there a missing LayerBegin is left to the executor, as it always was)."""
        if op.stream == _MAIN:
            return
        begun = self.begun.get(layer)
        if begun is None:
            self._fail(f"layer {layer}: op #{i} {describe(op)} reads the layer's routing, but "
                       f"no LayerBegin(layer {layer}) was issued before it")
        clock, j = begun
        if not self._before(clock, _MAIN, now):
            self._fail(f"layer {layer}: op #{i} {describe(op)} may read the layer's routing "
                       f"before op #{j} LayerBegin(layer {layer}) wrote it: no "
                       f"Wait({LANE_FORK}[{layer}]) on {op.stream} joins a "
                       f"Record({LANE_FORK}[{layer}]) issued on {_MAIN} after op #{j}")

    def _combine(self, i: int, op: LayerEnd, now: Clock) -> None:
        """The combine reads every row its layer's products wrote, on whichever lane."""
        for clock, j, p in self.multiplied.pop(op.layer, []):
            if not self._before(clock, p.stream, now):
                self._fail(f"layer {op.layer}: op #{i} LayerEnd(layer {op.layer}) combines "
                           f"rows that op #{j} {describe(p)} may still be writing: no "
                           f"Wait({LANE_JOIN}[{op.layer}]) on {op.stream} joins a "
                           f"Record({LANE_JOIN}[{op.layer}]) issued on {p.stream} after "
                           f"op #{j}")
        self.ended[op.layer] = i

    def _copy(self, i: int, op: Copy) -> None:
        k, s = op.entry, op.slot
        if self.ring == 0:
            self._fail(f"op #{i} {describe(op)}: the plan has no expert ring (a decode plan "
                       "gathers from resident slots and the host store)")
        if s != k % self.ring:
            self._fail(f"slot {s}: op #{i} {describe(op)} puts entry {k} in slot {s}, but "
                       f"entry k goes to slot k % {self.ring} = {k % self.ring}")
        if k in self.copies:
            self._fail(f"slot {s}: op #{i} {describe(op)} issues entry {k} a second time "
                       f"(first at op #{self.copies[k]})")
        if k >= self.consumed + self.ring:
            self._fail(f"slot {s}: op #{i} {describe(op)} over-runs the consumer: entry {k} "
                       f">= consumed {self.consumed} + ring {self.ring} (entry "
                       f"{k - self.ring}, the slot's previous occupant, is not consumed yet)")
        self._check(self.switches.chain(i, op))
        self._check(self.switches.copy(i, op, now := self._tick(op.stream)))
        prev = self.slots.get(s)
        if prev is not None:
            for rclock, lane, rop, rdesc in prev.readers:
                if not self._before(rclock, lane, now):
                    self._fail(
                        f"slot {s}: op #{i} {describe(op)} refills the slot while op #{rop} "
                        f"{rdesc} (entry {prev.entry}, layer {prev.layer} expert "
                        f"{prev.expert}) may still read it: no Wait(used[{s}]) on {op.stream} "
                        f"joins a Record(used[{s}]) issued on {lane} after op #{rop}")
        self.copies[k] = i
        self.slots[s] = Occupant(k, op.layer, op.expert, now, i, op.stream)

    def _gather(self, i: int, g: Gather, now: Clock, desc: str, what: str,
                host_ok: bool = False) -> None:
        """desc: the op as messages name it; what: the read, as a later refill names it.
        host_ok: the gather may read the host store itself (a GatherRouted member)."""
        kind, idx = g.src
        if kind == HOST:
            if not host_ok:
                self._fail(f"{desc}: only a GatherRouted reads the host store; a plain gather "
                           "needs its blob copied into a ring slot first")
            if self.residency is not None and self.residency.slot(g.layer, g.expert) is not None:
                self._fail(f"{desc} reads the host store, but layer {g.layer} expert "
                           f"{g.expert} resides in slot "
                           f"{self.residency.slot(g.layer, g.expert)}")
            self._place(g, i)
            return
        if kind == RESIDENT:
            if self.residency is not None and self.residency.slot(g.layer, g.expert) != idx:
                self._fail(f"resident slot {idx}: {desc} but layer {g.layer} expert "
                           f"{g.expert} resides in slot "
                           f"{self.residency.slot(g.layer, g.expert)}")
            self._place(g, i)
            return
        if kind != RING:
            self._fail(f"{desc}: unknown source {g.src!r}")
        s, k = idx, g.entry
        if k is None:
            self._fail(f"slot {s}: {desc} reads the ring without naming its entry")
        if k < self.consumed:
            self._fail(f"slot {s}: Consume at op #{self.consume_op} passed entry {k} "
                       f"(consumed = {self.consumed}) before {desc} read it: the issuer may "
                       f"already refill the slot")
        if k not in self.copies:
            if k >= self.consumed + self.ring:
                self._fail(
                    f"slot {s}: wait cycle: {desc} needs entry {k} (layer {g.layer} expert "
                    f"{g.expert}) before its Copy is issued, while the issuer needs consumed "
                    f"to reach {k - self.ring + 1} first (consumed = {self.consumed}, last "
                    f"Consume at op #{self.consume_op})")
            self._fail(f"slot {s}: {desc} reads entry {k} (layer {g.layer} expert {g.expert}) "
                       f"before its Copy was issued")
        occ = self.slots.get(s)
        if occ is None or occ.entry != k:
            self._fail(f"slot {s}: {desc} expects entry {k} but Copy at op "
                       f"#{occ.op_index if occ else '?'} already overwrote it with entry "
                       f"{occ.entry if occ else '?'}")
        if (occ.layer, occ.expert) != (g.layer, g.expert):
            self._fail(f"slot {s}: {desc} expects layer {g.layer} expert {g.expert} but entry "
                       f"{k} (Copy at op #{occ.op_index}) is layer {occ.layer} expert "
                       f"{occ.expert}")
        if not self._before(occ.clock, occ.stream, now):
            self._fail(f"slot {s}: {desc} may read before op #{occ.op_index} {occ.describe()} "
                       f"landed: no Wait(copied[{s}]) on {g.stream} joins a "
                       f"Record(copied[{s}]) issued on {occ.stream} after op #{occ.op_index}")
        self._check(self.switches.read(desc, s, k, host_ok))
        occ.readers.append((now, g.stream, i, what))
        self._place(g, i)

    def _place(self, g: Gather, i: int) -> None:
        """Into the group buffers of the gather's lane (the launch checked it is one)."""
        self.buffers[g.stream][g.pos] = (g.layer, g.group, g.expert, i)

    def _products(self, i: int, op: Products | LayerProducts | RoutedExperts,
                  now: Clock) -> None:
        if op.layer in self.ended:
            self._fail(f"layer {op.layer}: op #{i} {describe(op)} runs after op "
                       f"#{self.ended[op.layer]} LayerEnd(layer {op.layer}), whose combine "
                       "has already read the layer's rows: products belong before it")
        self._reads_routing(i, op, op.layer, now)
        self._check(products_problem(i, op, self.multiplied.get(op.layer, []), self.residency,
                                     self.images))
        self.multiplied.setdefault(op.layer, []).append((now, i, op))
        # products reading no group buffer: a whole layer's, resident slots, an image block
        if not isinstance(op, Products) or op.slots is not None or op.cached is not None:
            return
        for p, e in enumerate(op.expert_ids):
            have = self.buffers[op.stream].get(p)
            if have is None or have[:3] != (op.layer, op.group, e):
                what = ("was never gathered" if have is None else
                        f"holds layer {have[0]} group {have[1]} expert {have[2]} "
                        f"(op #{have[3]})")
                self._fail(f"op #{i} {describe(op)} reads position {p} as expert {e}, but "
                           f"that position of {op.stream}'s group buffers {what}"
                           + elsewhere_hint(self.buffers, op, p, e))

    def _consume(self, i: int, op: Consume, readers: dict[int, int]) -> None:
        if op.entry + 1 < self.consumed:
            self._fail(f"op #{i} Consume({op.entry}) goes back: consumed is already "
                       f"{self.consumed}")
        for k in range(self.consumed, op.entry + 1):
            r = readers.get(k)
            if r is not None and r > i:
                s = k % self.ring
                self._fail(f"slot {s}: op #{i} Consume({op.entry}) passes entry {k} which the "
                           f"not-yet-launched gather at op #{r} still reads")
        self.consumed = max(self.consumed, op.entry + 1)
        self.consume_op = i
