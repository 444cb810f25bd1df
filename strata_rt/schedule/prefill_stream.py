"""Which way a prefill chunk streams its non-resident experts: the walk or the routed plan.

The walk (planner.plan_walk) copies every non-resident expert of every layer on the copy
engine while the compute lanes work, so its PCIe time hides behind compute but its bytes do
not depend on the routing. The routed plan (planner.plan_routed) lets each gather read only
the experts the chunk routes, straight from the pinned host store, on the compute lane. A
short chunk routes far fewer experts than the uniform-routing estimate says (real routers
are uneven, per prompt and per layer), so how many bytes the routed plan would move is taken
from what earlier chunks of a length actually routed, never assumed:

- after every chunk short enough for the routed plan to matter (`ROUTED_MAX_TOKENS`), the
  driver reads the chunk's routing back once (one small copy after the chunk, no wait per
  layer) and records the bytes of its routed non-resident experts against its length;
- a chunk takes the routed plan when the bytes measured for that length, or for the nearest
  longer length measured (routing more tokens never routes fewer experts in expectation),
  are below `ROUTED_BYTE_SHARE` of what the walk would copy; a length with no measurement
  at or above it takes the walk, which then measures it.

`prefill_stream` "walk" or "routed" (STRATA_PREFILL_STREAM) forces one plan for every chunk.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Literal

#: chunks longer than this always take the walk (their routing is never read back): at
#: top-8 of 128 experts a chunk of a few thousand tokens routes nearly every expert
ROUTED_MAX_TOKENS = 4096
#: the routed plan is taken when its measured bytes are below this share of the walk's: its
#: reads run on the compute lane at the gathers' PCIe rate, which an H200 measured at 0.44 of
#: the copy engine's beside the compute (bench/notes.md W44)
ROUTED_BYTE_SHARE = 0.45

StreamMode = Literal["walk", "routed"]


class StreamChooser:
    """The per-length record of routed non-resident bytes and the rule above."""

    def __init__(self, share: float = ROUTED_BYTE_SHARE,
                 max_tokens: int = ROUTED_MAX_TOKENS) -> None:
        self.share = share
        self.max_tokens = max_tokens
        #: chunk length -> bytes of routed non-resident experts, the latest chunk of that length
        self.measured: dict[int, int] = {}

    def wants_routing(self, tokens: int) -> bool:
        """Whether a chunk of this length should have its routing read back and recorded."""
        return tokens <= self.max_tokens

    def observe(self, tokens: int, routed_bytes: int) -> None:
        self.measured[int(tokens)] = int(routed_bytes)

    def estimate(self, tokens: int) -> int | None:
        """Bytes the routed plan would move for this length: its own measurement, else the
        nearest longer length's; None when nothing at or above it was measured."""
        if tokens in self.measured:
            return self.measured[tokens]
        lengths = sorted(self.measured)
        i = bisect_left(lengths, tokens)
        return self.measured[lengths[i]] if i < len(lengths) else None

    def choose(self, tokens: int, walk_bytes: int, forced: str = "auto") -> StreamMode:
        if forced in ("walk", "routed"):
            return forced  # type: ignore[return-value]
        if tokens > self.max_tokens or walk_bytes <= 0:
            return "walk"
        routed = self.estimate(tokens)
        if routed is None or routed >= self.share * walk_bytes:
            return "walk"
        return "routed"
