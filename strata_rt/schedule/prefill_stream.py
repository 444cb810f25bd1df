"""Which way a prefill chunk streams its non-resident experts: the walk, the routed walk or the
routed plan.

The walk (planner.plan_walk) copies every non-resident expert of every layer on the copy
engine while the compute lanes work, so its PCIe time hides behind compute but its bytes do
not depend on the routing. The routed walk (the same planner, routed copies) copies only the
experts each layer routes, switched on the device, on the copy engine, but a layer's copies
wait for its routing. The routed plan (planner.plan_routed) lets each gather read only the
experts the chunk routes, straight from the pinned host store, on the compute lane. A
short chunk routes far fewer experts than the uniform-routing estimate says (real routers
are uneven, per prompt and per layer), so how many bytes the routed plan would move is taken
from what earlier chunks of a length actually routed, never assumed:

- after every chunk short enough for the routed plan to matter (`ROUTED_MAX_TOKENS`), the
  driver reads the chunk's routing back once (one small copy after the chunk, no wait per
  layer) and records the bytes of its routed non-resident experts against its length;
- a chunk streams only its routed experts when the bytes measured for that length, or for
  the nearest longer length measured (routing more tokens never routes fewer experts in
  expectation), are below `ROUTED_BYTE_SHARE` of what the walk would copy: by the routed
  walk where the executor switches copies on the device (it beat the routed plan at 254 and
  1,030 tokens on an H200, bench/notes.md W61), else by the routed plan; a length with no
  measurement at or above it takes the walk, which then measures it.

`prefill_stream` "walk", "routed" or "routed_walk" (STRATA_PREFILL_STREAM) forces one plan for
every chunk.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Literal

#: chunks longer than this always take the walk (their routing is never read back): at
#: top-8 of 128 experts a chunk of a few thousand tokens routes nearly every expert
ROUTED_MAX_TOKENS = 4096
#: only routed experts stream when their measured bytes are below this share of the walk's:
#: the routed plan's reads run on the compute lane at 0.44 of the copy engine's rate (an H200,
#: bench/notes.md W44); the routed walk's copies wait for each layer's routing, which on an
#: H200 made it 25% faster than the walk at a 39% share and even at a 50% share (W61)
ROUTED_BYTE_SHARE = 0.45

StreamMode = Literal["walk", "routed", "routed_walk"]


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

    def choose(self, tokens: int, walk_bytes: int, forced: str = "auto",
               routed_copies: bool = False) -> StreamMode:
        """routed_copies: the executor can run a routed walk (it switches copies on the
        device and its ring holds a group)."""
        if forced in ("walk", "routed", "routed_walk"):
            return forced  # type: ignore[return-value]
        if tokens > self.max_tokens or walk_bytes <= 0:
            return "walk"
        routed = self.estimate(tokens)
        if routed is None or routed >= self.share * walk_bytes:
            return "walk"
        return "routed_walk" if routed_copies else "routed"
