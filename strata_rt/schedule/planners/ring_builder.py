"""The ring builder the planners share: the issuer/consumer rules of the streaming design, in
one place (strata_rt.schedule.planners.planner says what they are), and the op emission of a layer's
routing, gathers, products and combine around them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ...formats.contract import MMQ_GROUP
from ..plan import (
    COPY_CHAINS,
    LANES,
    RESIDENT,
    RING,
    Consume,
    Copy,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerBegin,
    LayerEnd,
    Op,
    Products,
    Record,
    RouteCopies,
    StreamName,
    Wait,
    copied,
    copies_routed,
    lane_fork,
    lane_join,
    used,
)

if TYPE_CHECKING:
    from ..vram.residency import Residency


class RingBuilder:
    """Ring state and op emission shared by the walk and the staging planner.

    routed_copies (a routed walk): copies are issued no further than the layer whose routing
    is known (`horizon`), each switched by its layer's RouteCopies, and every group gathers
    with one GatherRouted, which skips the unrouted experts whose copies were switched off.
    A group's gathers are then one launch from position 0, so the ring must hold the ring
    entries of any one group (group_ring_entries). copy_chains (a routed walk only): entry k
    is copied on COPY_CHAINS[k % copy_chains]."""

    def __init__(self, residency: Residency, ring_slots: int, gather_one: bool,
                 lanes: int = 1, in_place: bool = False, routed_copies: bool = False,
                 copy_chains: int = 1):
        if ring_slots < 1:
            raise ValueError(f"ring_slots={ring_slots}: the ring needs at least one slot")
        if not 1 <= lanes <= len(LANES):
            raise ValueError(f"lanes={lanes}: a plan has 1..{len(LANES)} compute lanes")
        if not 1 <= copy_chains <= (len(COPY_CHAINS) if routed_copies else 1):
            raise ValueError(f"copy_chains={copy_chains}: a routed walk has 1.."
                             f"{len(COPY_CHAINS)} copy chains, any other plan one")
        self.chains = COPY_CHAINS[:copy_chains]
        self.residency = residency
        self.lanes = lanes
        self.in_place = in_place               # products read resident groups in place
        self.lane: StreamName = LANES[0]       # the lane of the group being planned
        self.forked: set[StreamName] = set()   # lanes that waited for this layer's fork
        self.ring = ring_slots
        self.routed = routed_copies
        self.horizon = -1 if routed_copies else None  # the last layer copies may reach
        self.batch = routed_copies or not gather_one
        self.seq: list[tuple[int, int]] = []   # entry -> (layer, expert)
        self.issued = 0                        # entries issued so far
        self.consumed = 0                      # entries released so far (count)
        self.next_entry = 0                    # the next entry the consumer reads
        self.pending: list[Gather] = []        # gathers waiting for the batch launch
        #: a layer pass's chunks before the layer's last: their gathers keep the slots
        #: (no used record, no Consume), which the last chunk's gathers then release
        self.hold = False
        self.ops: list[Op] = []

    # ------------------------------------------------------------------ issuer
    def issue_available(self) -> None:
        while self.issued < len(self.seq) and self.issued < self.consumed + self.ring:
            k = self.issued
            layer, expert = self.seq[k]
            if self.horizon is not None and layer > self.horizon:
                break  # its routing is not known yet: RouteCopies has not switched it
            slot = k % self.ring
            chain = self.chains[k % len(self.chains)]
            if k >= self.ring:
                self.ops.append(Wait(used(slot), chain))
            self.ops.append(Copy(k, layer, expert, slot, self.routed, chain))
            self.ops.append(Record(copied(slot), chain))
            self.issued += 1

    # ------------------------------------------------------------------ consumer
    def _release(self, gathers: Sequence[Gather]) -> None:
        if self.hold:
            return
        ring = [g for g in gathers if g.src[0] == RING]
        for g in ring:
            self.ops.append(Record(used(g.src[1]), self.lane))
        if ring:
            last = max(_ring_entry(g) for g in ring)
            self.ops.append(Consume(last))
            self.consumed = last + 1
            self.issue_available()

    def flush(self) -> None:
        if not self.pending:
            return
        batch = tuple(self.pending)
        self.pending = []
        if self.routed:
            if batch[0].pos != 0:
                raise AssertionError("planner: a routed walk's group was split mid-way")
            self.ops.append(GatherRouted(batch[0].group, batch, self.lane))
        else:
            self.ops.append(GatherBatch(batch[0].group, batch[0].pos, batch, self.lane))
        self._release(batch)

    def gather(self, group: int, pos: int, layer: int, expert: int) -> None:
        slot = self.residency.slot(layer, expert)
        if slot is not None:
            g = Gather(group, pos, layer, expert, (RESIDENT, slot), stream=self.lane)
        else:
            k = self.next_entry
            if k >= len(self.seq) or self.seq[k] != (layer, expert):
                raise AssertionError(f"planner: entry {k} is not layer {layer} expert {expert}")
            self.next_entry += 1
            if k >= self.issued:
                self.issue_available()
            if k >= self.issued:
                self.flush()
                self.issue_available()
            assert k < self.issued, "issuer cannot reach the entry the consumer needs"
            self.ops.append(Wait(copied(k % self.ring), self.lane))
            g = Gather(group, pos, layer, expert, (RING, k % self.ring), k, self.lane)
        if self.batch:
            self.pending.append(g)
        else:
            self.ops.append(g)
            self._release([g])

    def begin_layer(self, layer: int) -> None:
        """The layer's routing, and the fork the other lanes' products wait for; in a routed
        walk, the switches of the layer's copies, which the copy stream then waits for."""
        self.ops.append(LayerBegin(layer))
        self.forked = set()
        if self.lanes > 1:
            self.ops.append(Record(lane_fork(layer), LANES[0]))
        if self.horizon is not None:
            pairs = tuple((k, e) for k, (lay, e) in enumerate(self.seq) if lay == layer)
            if pairs:
                self.ops.append(RouteCopies(layer, pairs))
                self.ops.append(Record(copies_routed(layer), LANES[0]))
                self.ops += [Wait(copies_routed(layer), chain) for chain in self.chains]
            self.horizon = layer
            self.issue_available()

    def _fork(self, layer: int) -> None:
        """The lane of the group being planned waits for the layer's routing (once)."""
        if self.lane != LANES[0] and self.lane not in self.forked:
            self.ops.append(Wait(lane_fork(layer), self.lane))
            self.forked.add(self.lane)

    def group(self, layer: int, group: int, experts: Sequence[int],
              cached: int | None = None) -> None:
        """Group `group`'s gathers and products, on lane group % lanes. A group held by the
        image cache, or (in_place) one whose experts are all resident, gathers nothing."""
        self.lane = LANES[group % self.lanes]
        ids = tuple(int(e) for e in experts)
        slots = (resident_slots(self.residency, layer, ids)
                 if cached is None and self.in_place else None)
        if cached is None and slots is None:
            if self.routed:  # GatherRouted reads the layer's routing
                self._fork(layer)
            for pos, e in enumerate(experts):
                self.gather(group, pos, layer, e)
            self.flush()
        self._fork(layer)
        self.ops.append(Products(layer, group, ids, cached, self.lane, slots))

    def end_layer(self, layer: int) -> None:
        """Joins the lanes that multiplied in this layer, then the combine."""
        for lane in LANES[1:]:
            if lane in self.forked:
                self.ops.append(Record(lane_join(layer), lane))
                self.ops.append(Wait(lane_join(layer), LANES[0]))
        self.ops.append(LayerEnd(layer))

    def take_ops(self) -> tuple[Op, ...]:
        ops, self.ops = tuple(self.ops), []
        return ops


def _ring_entry(g: Gather) -> int:
    entry = g.entry
    if entry is None:  # the builder names the entry of every ring gather it emits
        raise AssertionError(f"ring gather without an entry: {g!r}")
    return entry


def resident_slots(residency: Residency, layer: int, experts: Sequence[int]
                   ) -> tuple[int, ...] | None:
    """The resident slot of each of a group's experts, or None when any of them streams: the
    slots a group's products read in place (plan.Products.slots)."""
    slots = []
    for e in experts:
        slot = residency.slot(layer, e)
        if slot is None:
            return None
        slots.append(int(slot))
    return tuple(slots)


def groups_of(experts: Sequence[int]) -> list[list[int]]:
    return [list(experts[i:i + MMQ_GROUP]) for i in range(0, len(experts), MMQ_GROUP)]


def group_ring_entries(residency: Residency, layers: Iterable[int], n_experts: int) -> int:
    """The most non-resident experts one group of `layers` holds: the ring slots a routed walk
    needs, since it gathers each group in one launch."""
    streamed = ~residency.mask()
    return max((int(streamed[layer, g:g + MMQ_GROUP].sum()) for layer in layers
                for g in range(0, n_experts, MMQ_GROUP)), default=0)

