"""What the hazard checker (strata_rt.schedule.hazards) asks of a whole model's streamed dense
weights: a DenseCopy must not refill a dense ring slot an Attention may still read, and an
Attention must find its own layer in its slot, copied before it runs.

Its own module so that schedule/hazards/checker.py keeps to the ordering of the expert ring and the
lanes; the clocks and the happens-before test are the checker's (passed in). Each check
returns the problem as text (None when there is none), and the checker raises it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..plan import LANES, Attention, DenseCopy
from .messages import Clock, describe

#: the lane every Attention runs on
_MAIN = LANES[0]


class DenseRing:
    """Per dense ring slot: the layer its last DenseCopy brought (that copy's clock and op
    index) and the Attentions that read it since. before(a, stream_a, b): whether the op of
    clock a on stream_a happens before the op of clock b."""

    def __init__(self, before: Callable[[Clock, str, Clock], bool]):
        self._before = before
        self.held: dict[int, tuple[int, Clock, int]] = {}
        self.readers: dict[int, list[tuple[Clock, int]]] = {}

    def copy(self, i: int, op: DenseCopy, now: Clock) -> str | None:
        """Op #i refills op.slot at `now` (its copy-stream clock)."""
        for clock, j in self.readers.get(op.slot, []):
            if not self._before(clock, _MAIN, now):
                return (f"dense slot {op.slot}: op #{i} {describe(op)} may overwrite it while op "
                        f"#{j} (an Attention reading layer {self.held[op.slot][0]}) still "
                        "reads it; the copy stream must wait for that Attention's dense_used "
                        "record")
        self.held[op.slot] = (op.layer, now, i)
        self.readers[op.slot] = []
        return None

    def read(self, i: int, op: Attention, now: Clock) -> str | None:
        """Op #i, an Attention at `now`, reads its dense slot (resident weights: nothing)."""
        s = op.dense_slot
        if s is None:
            return None
        occ = self.held.get(s)
        if occ is None:
            return f"dense slot {s}: op #{i} {describe(op)} reads it before any DenseCopy"
        if occ[0] != op.layer:
            return (f"dense slot {s}: op #{i} {describe(op)} finds layer {occ[0]} there "
                    f"(copied by op #{occ[2]})")
        if not self._before(occ[1], "copy", now):
            return (f"dense slot {s}: op #{i} {describe(op)} may run before op #{occ[2]} "
                    f"{describe(DenseCopy(occ[0], s))} lands (no wait on its dense_copied "
                    "record)")
        self.readers[s].append((now, i))
        return None
