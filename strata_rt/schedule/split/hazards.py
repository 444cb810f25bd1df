"""The hazard checker across the devices of a layer split.

Each part's plan is replayed by its own hazards.Checker (its streams, ring and buffers); this
module orders the parts against each other. Only the hand-off crosses devices, and every op
that touches it runs on a part's main compute lane, so cross-device order is tracked with one
vector per part: know[p][q] is the last tick of part q's main lane that part p's main lane is
ordered after (through a Wait on a hand-off event recorded by q, or by a part that knew q).
Ticks count across chunks (a part's lane keeps its order from one chunk to the next), and the
plans are fed in host issue order: chunk by chunk, each chunk part by part.

Rejected (each message names the part, its chunk, the boundary and the op):
- a HandOff whose copy of the sender's residual is not ordered after the sender's last write
  to it in that chunk (its last LayerEnd): no Wait on a handoff_ready recorded after it;
- an op bringing a part's next input (ChunkInput, HandOff) that may overwrite the residual
  while the receiver's HandOff of the previous chunk may still copy it: no Wait on the
  receiver's handoff_taken;
- a HandOff naming the wrong sender, receiver or boundary, or issued before the sender's plan
  of its chunk; a hand-off Record or Wait off the main compute lane; a Wait on a hand-off
  event never recorded (except a sender's first handoff_taken wait: nothing came before, and
  CUDA treats an event never recorded as complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ...errors import PlanHazardError
from ..hazards import Checker
from ..plan import (
    COPY_CHAINS,
    HANDOFF_READY,
    HANDOFF_TAKEN,
    LANES,
    ChunkPlan,
    HandOff,
    Record,
    Wait,
)

if TYPE_CHECKING:
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency
    from . import LayerSplit

_MAIN = LANES[0]


class SplitChecker:
    """Feed each part's plan of each chunk in host order (feed(part, plan))."""

    def __init__(self, split: LayerSplit, residencies: Sequence[Residency | None],
                 images: Sequence[ImageCache | None] | None = None):
        self.parts = split.parts
        n = len(self.parts)
        self.residencies = list(residencies)
        self.images = list(images) if images is not None else [None] * n
        self.know = [[0] * n for _ in range(n)]
        self.base = [0] * n                    # main-lane ticks of earlier chunks, per part
        self.chunk = [-1] * n                  # the chunk each part is at
        self.events: dict[tuple[str, int], list[int]] = {}
        #: (part, chunk) -> global tick of its last residual write / of its HandOff
        self.final: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], tuple[int, int]] = {}
        self._part = 0

    def _fail(self, i: int, msg: str) -> NoReturn:
        raise PlanHazardError(f"part {self._part} (device {self.parts[self._part].device}), "
                              f"chunk {self.chunk[self._part]}: op #{i} {msg}")

    def _now(self, checker: Checker) -> int:
        """The global tick of the part's main lane (its clock component follows the copy
        streams', as hazards orders them)."""
        return self.base[self._part] + checker.clock[_MAIN][len(COPY_CHAINS) + LANES.index(_MAIN)]

    def feed(self, part: int, plan: ChunkPlan) -> None:
        """Checks part `part`'s plan of its next chunk."""
        self._part = part
        self.chunk[part] += 1
        checker = Checker(plan.ring_slots, self.residencies[part], self.images[part],
                          link=self)
        for lp in plan.layers:
            if lp.layer not in self.parts[part].layers:
                raise PlanHazardError(f"part {part}: its plan holds layer {lp.layer}, outside "
                                      f"its layers {self.parts[part].first}.."
                                      f"{self.parts[part].end - 1}")
            checker.feed(lp.ops)
        if not checker.rows.has_input():
            raise PlanHazardError(f"part {part}, chunk {self.chunk[part]}: the plan brings no "
                                  "input (no ChunkInput or HandOff)")
        self.final[(part, self.chunk[part])] = self.base[part] + checker.wrote
        self.base[part] = self._now(checker)

    # ------------------------------------------------------------------ the link
    def op(self, checker: Checker, i: int, op: Record | Wait | HandOff) -> None:
        p = self._part
        if op.stream != _MAIN:
            self._fail(i, f"{type(op).__name__} of a hand-off on {op.stream}: the hand-off "
                       f"runs on each part's main lane ({_MAIN})")
        if isinstance(op, HandOff):
            self._handoff(checker, i, op)
            return
        kind, boundary = op.event
        if isinstance(op, Record):
            checker.tick(_MAIN)
            vec = list(self.know[p])
            vec[p] = self._now(checker)
            self.events[op.event] = vec
            return
        rec = self.events.get(op.event)
        if rec is None and not (kind == HANDOFF_TAKEN and self.chunk[p] == 0):
            self._fail(i, f"Wait({kind}[{boundary}]) waits on a hand-off event that was never "
                       "recorded (CUDA would not wait at all)")
        if rec is not None:
            self.know[p] = [max(a, b) for a, b in zip(self.know[p], rec)]
        checker.tick(_MAIN)

    def _handoff(self, checker: Checker, i: int, op: HandOff) -> None:
        p, c = self._part, self.chunk[self._part]
        part = self.parts[p]
        if (op.dst, op.src, op.boundary) != (p, p - 1, part.first):
            self._fail(i, f"{op!r}: part {p} receives from part {p - 1} at layer "
                       f"{part.first}" if p else f"{op!r}: the first part takes ChunkInput")
        if self.chunk[op.src] != c:
            self._fail(i, f"HandOff(boundary {op.boundary}) before part {op.src}'s plan of "
                       f"chunk {c} was issued")
        final = self.final[(op.src, c)]
        if self.know[p][op.src] < final:
            self._fail(i, f"HandOff(boundary {op.boundary}) may copy part {op.src}'s residual "
                       f"before its last LayerEnd of chunk {c} wrote it: no Wait("
                       f"{HANDOFF_READY}[{op.boundary}]) on {_MAIN} joins a Record("
                       f"{HANDOFF_READY}[{op.boundary}]) issued on part {op.src} after it")
        checker.arrive(i, "HandOff")
        checker.tick(_MAIN)
        self.taken[(p, c)] = (self._now(checker), i)

    def overwrites(self, checker: Checker, i: int, what: str) -> None:
        """Part p's input op overwrites its residual: its receiver's HandOff of the previous
        chunk must be ordered before it."""
        p, c = self._part, self.chunk[self._part]
        if not self.parts[p].sends or c == 0:
            return
        got = self.taken.get((p + 1, c - 1))
        if got is None:
            self._fail(i, f"{what} overwrites the residual before part {p + 1}'s HandOff of "
                       f"chunk {c - 1} was issued")
        tick, j = got
        if self.know[p][p + 1] < tick:
            b = self.parts[p].end
            self._fail(i, f"{what} overwrites the residual that part {p + 1}'s HandOff (op "
                       f"#{j} of its chunk {c - 1}) may still copy: no Wait({HANDOFF_TAKEN}"
                       f"[{b}]) on {_MAIN} joins its Record({HANDOFF_TAKEN}[{b}])")


def check_split(split: LayerSplit, chunks: Sequence[Sequence[ChunkPlan]],
                residencies: Sequence[Residency | None],
                images: Sequence[ImageCache | None] | None = None) -> None:
    """Raises PlanHazardError on the first hazard of a split's plans: chunks[c][p] is part
    p's plan of chunk c, issued in that order."""
    checker = SplitChecker(split, residencies, images)
    for plans in chunks:
        if len(plans) != len(split.parts):
            raise ValueError(f"{len(plans)} plans for a split of {len(split.parts)} parts")
        for p, plan in enumerate(plans):
            checker.feed(p, plan)
