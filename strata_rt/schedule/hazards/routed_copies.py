"""What the hazard checker asks of a routed walk's copies (plan.Copy.routed, plan.RouteCopies).

A routed Copy lands only if its layer's routing gave the expert rows; a kernel in its layer's
RouteCopies sets that switch on the device. So:
- a RouteCopies runs on the main lane after its layer's LayerBegin (which writes the routing)
  and switches each entry once, naming the (entry, expert) pairs its layer's copies carry;
- a routed Copy needs the RouteCopies that switched its entry to happen before it (the copy
  stream waits for a copies_routed event recorded after it), or the copy would read a switch
  still holding the previous chunk's value;
- a ring slot filled by a routed Copy is read only by a GatherRouted member, which skips the
  experts the routing gave no rows, the very experts whose copies were switched off; a plain
  gather would read the slot's previous bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from ..plan import COPY_CHAINS, LANES, Copy, RouteCopies
from .messages import Clock, describe

#: the lane of the routing (LayerBegin) and of RouteCopies
_MAIN = LANES[0]


@dataclass(frozen=True)
class _Switch:
    clock: Clock
    op_index: int
    layer: int
    expert: int


class CopySwitches:
    """The switches of one chunk's routed copies; each method returns a problem or None.
    before(clock_a, stream_a, clock_b): the checker's happens-before test."""

    def __init__(self, before: Callable[[Clock, str, Clock], bool]):
        self._before = before
        self.switched: dict[int, _Switch] = {}
        self.routed: set[int] = set()  # entries whose Copy was routed

    def route(self, i: int, op: RouteCopies, now: Clock, begun: Container[int]) -> str | None:
        what = f"op #{i} RouteCopies(layer {op.layer})"
        if op.stream != _MAIN:
            return f"{what} runs on {op.stream}: it reads the routing on {_MAIN}"
        if op.layer not in begun:
            return (f"layer {op.layer}: {what} switches the layer's copies from its routing, "
                    f"but no LayerBegin(layer {op.layer}) was issued before it")
        for k, e in op.copies:
            if k in self.switched:
                return (f"{what} switches entry {k} a second time (first at op "
                        f"#{self.switched[k].op_index})")
            self.switched[k] = _Switch(now, i, op.layer, e)
        return None

    @staticmethod
    def chain(i: int, op: Copy) -> str | None:
        """A copy runs on one of the copy streams, and off the first only in a routed walk."""
        if op.stream in COPY_CHAINS[:1] or (op.stream in COPY_CHAINS and op.routed):
            return None
        return (f"op #{i} {describe(op)} runs on {op.stream}: a copy goes on "
                f"{COPY_CHAINS[0]}, or in a routed walk on one of {', '.join(COPY_CHAINS)}")

    def copy(self, i: int, op: Copy, now: Clock) -> str | None:
        if not op.routed:
            return None
        what = f"slot {op.slot}: op #{i} {describe(op)}"
        sw = self.switched.get(op.entry)
        if sw is None:
            return (f"{what} is routed, but no RouteCopies before it switched entry "
                    f"{op.entry}")
        if (sw.layer, sw.expert) != (op.layer, op.expert):
            return (f"{what}: op #{sw.op_index} switched entry {op.entry} as layer {sw.layer} "
                    f"expert {sw.expert}")
        if not self._before(sw.clock, _MAIN, now):
            return (f"{what} may run before op #{sw.op_index} RouteCopies(layer {sw.layer}) "
                    f"set its switch: no Wait(copies_routed[{sw.layer}]) on {op.stream} "
                    f"joins a Record(copies_routed[{sw.layer}]) issued on {_MAIN} after it")
        self.routed.add(op.entry)
        return None

    def read(self, desc: str, slot: int, entry: int, skips_unrouted: bool) -> str | None:
        """A gather reading ring entry `entry`; skips_unrouted: a GatherRouted member."""
        if entry in self.routed and not skips_unrouted:
            return (f"slot {slot}: {desc} reads entry {entry}, whose routed Copy may have been "
                    "switched off: only a GatherRouted (skipping the same unrouted experts) "
                    "may read a routed copy's slot")
        return None
