"""How the hazard checker (strata_rt.schedule.hazards) names ops, events and ring-slot occupants in
its messages, and the occupant record it keeps per ring slot.

A module of its own so that schedule/hazards/checker.py keeps to one job, replaying a plan's ordering, while
its messages name every op the same way: the launch with what it reads or writes, and its compute
lane where that is not the first one (a reader of a two-lane plan needs the lane to see which
stream misses a wait; a one-lane plan's messages read as they always did).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import (
    COPIED,
    DENSE_COPIED,
    DENSE_USED,
    HOST,
    LANE_FORK,
    LANE_JOIN,
    LANES,
    RING,
    USED,
    Attention,
    Copy,
    DenseCopy,
    EventKey,
    Gather,
    GatherBatch,
    GatherRouted,
    LayerProducts,
    Op,
    Products,
    Record,
    RoutedExperts,
    Wait,
)

#: a vector clock: one component per stream (the copy stream, then the compute lanes)
Clock = tuple[int, ...]


def on_lane(stream: str) -> str:
    """The suffix naming a launch's lane: ' on compute2' off the first lane, '' on it."""
    return "" if stream == LANES[0] else f" on {stream}"


def describe(op: Op) -> str:
    if isinstance(op, Copy):
        return (f"Copy(entry {op.entry}, layer {op.layer}, expert {op.expert} -> slot {op.slot}"
                f"{', routed' if op.routed else ''})")
    if isinstance(op, Gather):
        where = (f"ring slot {op.src[1]}, entry {op.entry}" if op.src[0] == RING
                 else "the host store" if op.src[0] == HOST else f"resident slot {op.src[1]}")
        return (f"Gather(layer {op.layer}, expert {op.expert}, group {op.group} pos {op.pos}, "
                f"{where}){on_lane(op.stream)}")
    if isinstance(op, GatherBatch):
        return (f"GatherBatch(group {op.group}, positions {op.first_pos}.."
                f"{op.first_pos + len(op.gathers) - 1}){on_lane(op.stream)}")
    if isinstance(op, GatherRouted):
        return (f"GatherRouted(group {op.group}, positions 0..{len(op.gathers) - 1})"
                f"{on_lane(op.stream)}")
    if isinstance(op, Products):
        return f"Products(layer {op.layer}, group {op.group}){on_lane(op.stream)}"
    if isinstance(op, RoutedExperts):
        return f"RoutedExperts(layer {op.layer}){on_lane(op.stream)}"
    if isinstance(op, LayerProducts):
        n = sum(len(p.expert_ids) for p in op.parts)
        return (f"LayerProducts(layer {op.layer}, {len(op.parts)} parts, {n} experts)"
                f"{on_lane(op.stream)}")
    if isinstance(op, Record | Wait):
        return f"{type(op).__name__}({op.event[0]}[{op.event[1]}]) on {op.stream}"
    if isinstance(op, DenseCopy):
        return f"DenseCopy(layer {op.layer} -> dense slot {op.slot})"
    if isinstance(op, Attention) and op.dense_slot is not None:
        return f"Attention(layer {op.layer}, dense slot {op.dense_slot})"
    return repr(op)


def event_subject(event: EventKey) -> str:
    """What an event orders, as a message opens with it: "slot 3", "dense slot 1", "layer 2"."""
    kind, idx = event
    if kind in (COPIED, USED):
        return f"slot {idx}"
    if kind in (DENSE_COPIED, DENSE_USED):
        return f"dense slot {idx}"
    if kind in (LANE_FORK, LANE_JOIN):
        return f"layer {idx}"
    return f"event {kind}[{idx}]"


@dataclass
class Occupant:
    """The entry a ring slot holds: its Copy's clock and op index, and every launch that read
    it, as (clock, lane, op index, description): a refill must wait for each on its lane."""

    entry: int
    layer: int
    expert: int
    clock: Clock
    op_index: int
    stream: str = "copy"  # the copy stream the Copy ran on
    readers: list[tuple[Clock, str, int, str]] = field(default_factory=list)

    def describe(self) -> str:
        return f"Copy(entry {self.entry}, layer {self.layer}, expert {self.expert})"
