"""The Plan: one chunk's schedule as plain data, in host issue order.

Three readers share it (the CUDA executor, the numpy reference executor and the hazard checker),
so it carries everything each needs and nothing about CUDA. Each op says which stream it is
enqueued on: "copy" (host blob -> ring slot), "compute" (norm, routing, gathers, products,
combine) or "host" (the issuer/consumer bookkeeping that has no GPU work).

Compute lanes: a plan may put every other group's gathers and products on a second compute
stream, "compute2", with its own set of group buffers (LANES; lane i gathers into and multiplies
from set i). A launch of 16 experts leaves part of the GPU idle in its last wave and between
launches; two independent groups in flight fill those gaps, and a gather (memory bound) runs
beside the other lane's GEMMs (tensor bound). The layer orders the lanes with two events:
`Record((LANE_FORK, layer), "compute")` after its LayerBegin, waited on by "compute2" before
its first Products of the layer (its gathers read no routing, so they may run ahead), and
`Record((LANE_JOIN, layer), "compute2")` after its last Products, waited on by "compute" before
the LayerEnd that combines the rows both lanes wrote.

A whole model (strata_rt.models.qwen3) adds two compute ops: `Attention(layer)` opens each layer
(its RMSNorm, q/k/v projections, q/k norms and RoPE, the KV-cache append, causal attention and
the output projection added into the residual) and `Logits(rows)` closes the chunk (final norm
and output head). The MoE ops of the layer follow its Attention. When the dense weights stream
(they do not fit the budget), `DenseCopy(layer, slot)` brings a layer's dense slot from the
host into one of a few dense ring slots on the copy stream, with events `("dense_copied", s)`
and `("dense_used", s)` ordering it against the Attention that reads the slot, as the expert
ring's events do.

A layer split (several devices, strata_rt.schedule.split) gives each device a plan of its own
layers; a receiving device's plan opens with a HandOff in place of ChunkInput, and the events
`("handoff_ready", boundary)` / `("handoff_taken", boundary)` order it against its sender's
plan across devices (schedule/split/hazards.py checks them).

Ring bookkeeping: entry k of a chunk's stream of copies goes to ring slot
k % ring_slots. Events are `("copied", slot)` (recorded on the copy stream after a copy lands)
and `("used", slot)` (recorded on the compute stream after the last gather that reads the
slot). `Consume(entry)` tells the issuer that the slots of entries <= entry may be refilled:
entry k may be issued only while k < (last consumed entry + 1) + ring_slots.

A routed walk (planner.plan_walk with routed copies) keeps the walk's ring, entries and events
but copies only what each layer routes, with no host wait: its Copy ops are `routed`, issued
only once their layer's RouteCopies has switched them from the routing on the device (the copy
stream waits for `("copies_routed", layer)`), and its groups gather with GatherRouted, which
skips the same unrouted experts, so no launch reads a slot whose copy was switched off. Its
copies may go round-robin over several copy streams (COPY_CHAINS, `copy_chains`): a copy that
its switch turned off then costs its chain alone a node's time, and a group's copies land side
by side; each chain waits for the layer's copies_routed and records each slot's copied itself.

Table products: where every expert of a layer is read in place, the driver merges the layer's
in-place Products into one LayerProducts right after planning
(schedule.planners.layer_products), which multiplies the whole layer with one launch per
product through a device table of slot addresses; the planners themselves never emit it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..formats.contract import MMQ_GROUP

StreamName = Literal["copy", "copy2", "copy3", "copy4", "compute", "compute2", "host"]
#: the compute lanes in order; lane i owns group-buffer set i
LANES: tuple[StreamName, ...] = ("compute", "compute2")
#: the copy streams: "copy" for every plan; a routed walk may spread its switched copies over
#: the first copy_chains of them (entry k on COPY_CHAINS[k % copy_chains])
COPY_CHAINS: tuple[StreamName, ...] = ("copy", "copy2", "copy3", "copy4")
#: ("copied", slot) or ("used", slot)
EventKey = tuple[str, int]
#: ("resident", resident slot index), ("ring", ring slot) or ("host", 0): the blob read over
#: PCIe from the pinned host store by the gather itself (GatherRouted and RoutedExperts only)
Source = tuple[str, int]

COPIED = "copied"
USED = "used"
DENSE_COPIED = "dense_copied"
DENSE_USED = "dense_used"
LANE_FORK = "lane_fork"
LANE_JOIN = "lane_join"
#: a routed walk's layer: recorded after its RouteCopies, waited on by the copy stream
COPIES_ROUTED = "copies_routed"
#: a layer split's hand-off events, keyed by the boundary (the receiver's first layer):
#: recorded by the sender once its residual is final, and by the receiver once it has copied
HANDOFF_READY = "handoff_ready"
HANDOFF_TAKEN = "handoff_taken"
HANDOFF_EVENTS = (HANDOFF_READY, HANDOFF_TAKEN)
RESIDENT = "resident"
RING = "ring"
HOST = "host"


def copied(slot: int) -> EventKey:
    return (COPIED, slot)


def used(slot: int) -> EventKey:
    return (USED, slot)


def dense_copied(slot: int) -> EventKey:
    return (DENSE_COPIED, slot)


def dense_used(slot: int) -> EventKey:
    return (DENSE_USED, slot)


def lane_fork(layer: int) -> EventKey:
    return (LANE_FORK, layer)


def lane_join(layer: int) -> EventKey:
    return (LANE_JOIN, layer)


def handoff_ready(boundary: int) -> EventKey:
    return (HANDOFF_READY, boundary)


def handoff_taken(boundary: int) -> EventKey:
    return (HANDOFF_TAKEN, boundary)


def copies_routed(layer: int) -> EventKey:
    return (COPIES_ROUTED, layer)


def lane_index(stream: StreamName) -> int:
    """The group-buffer set of a compute lane."""
    return LANES.index(stream)


@dataclass(frozen=True)
class Copy:
    """Copy the blob of (layer, expert) from the host store into ring slot `slot`. `routed`:
    the copy happens only if the layer's routing gave the expert rows, as the RouteCopies
    of its layer switched it on the device (a routed walk); switched off, it copies nothing and
    the slot keeps its previous bytes, which only a GatherRouted member, skipping the same
    unrouted expert, may then be planned over."""

    entry: int
    layer: int
    expert: int
    slot: int
    routed: bool = False
    #: one of COPY_CHAINS ("copy" but in a routed walk of several copy chains)
    stream: StreamName = "copy"


@dataclass(frozen=True)
class RouteCopies:
    """After its layer's LayerBegin: switches each routed Copy of `copies` ((entry, expert)
    pairs of layer `layer`) on where the routing gave the expert rows and off elsewhere, on
    the device, so the host never learns the routed set. The copy stream waits for a Record
    after this op before its first routed Copy of the layer."""

    layer: int
    copies: tuple[tuple[int, int], ...]
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class Record:
    event: EventKey
    stream: StreamName


@dataclass(frozen=True)
class Wait:
    """`stream` waits for the latest Record of `event` issued before this op."""

    event: EventKey
    stream: StreamName


@dataclass(frozen=True)
class Gather:
    """Copy one expert's images into position `pos` of the group buffers of its lane
    (`stream`, one of LANES).

    `entry` is the ring entry the gather expects in a ring slot (None for a resident
    source); it lets the checker name the copy the gather depends on."""

    group: int
    pos: int
    layer: int
    expert: int
    src: Source
    entry: int | None = None
    stream: StreamName = "compute"


@dataclass(frozen=True)
class GatherBatch:
    """One launch doing `gathers` (consecutive positions from first_pos, same group, all on
    this op's lane)."""

    group: int
    first_pos: int
    gathers: tuple[Gather, ...]
    stream: StreamName = "compute"


@dataclass(frozen=True)
class GatherRouted:
    """One launch gathering the routed experts among `gathers` (consecutive positions from 0,
    same group): an expert the layer's routing gave no rows is skipped on the device. A decode
    step plans every expert this way, so its schedule does not depend on the routed set, which
    never comes back to the host, and the step can be replayed as a CUDA graph while it still
    gathers only the experts it uses. Members read resident slots or ("host", 0): the gather
    itself reads the blob from the pinned host store over PCIe (no Copy, no ring slot)."""
    group: int
    gathers: tuple[Gather, ...]
    stream: StreamName = "compute"


@dataclass(frozen=True)
class Products:
    """MMQ gate/up, SwiGLU + quantize, MMQ down over the group buffers of its lane
    (`stream`, one of LANES); position p holds expert_ids[p]. `cached`: the image-cache block
    holding these experts' images (strata_rt.schedule.vram.image_cache), which the products read in
    place of the group buffers (no gather precedes them); None: the group buffers. `slots`: the
    resident slot of each position's expert, whose blob the products read where it lies
    (FormatKernels.mmq_in_place; no gather precedes them either, and the lane's group buffers
    are left alone); None: the group buffers or the image cache."""

    layer: int
    group: int
    expert_ids: tuple[int, ...]
    cached: int | None = None
    stream: StreamName = "compute"
    slots: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LayerProducts:
    """Every expert of `layer` multiplied where its resident slot holds it, one launch per
    product: gate/up, SwiGLU + quantize and down, each over the whole layer
    (FormatKernels.mmq_table reads expert e's part at the address a device table holds for e).
    It replaces the layer's in-place Products (`parts`, one per group of 16 experts, each with
    its slots), which would cost three launches per group: with 128 experts, 24 launches of
    16 experts each, where a short chunk's few rows per expert leave most of every launch's
    last wave idle. The same experts, slots and rows as its parts, so the same bytes
    (schedule.planners.layer_products makes it where the layer's format offers the table kernel)."""

    layer: int
    parts: tuple[Products, ...]
    stream: StreamName = "compute"

    def stands_for(self) -> tuple[Products, ...]:
        """The in-place Products this op replaces, on its own stream (what the numpy executor
        runs for it, and what the hazard checker checks it as)."""
        return tuple(p if p.stream == self.stream else replace(p, stream=self.stream)
                     for p in self.parts)

    @property
    def slots(self) -> tuple[int, ...]:
        """Per expert id, its resident slot (slots[e]: expert e's; the parts cover experts
        0..n-1 once each, as the hazard checker holds them to)."""
        pairs = sorted((e, s) for p in self.parts for e, s in zip(p.expert_ids, p.slots or ()))
        return tuple(s for _, s in pairs)


@dataclass(frozen=True)
class RoutedExperts:
    """A decode step's expert products of `layer` as matrix-vector launches over the (token, k)
    pairs its routing picked (FormatKernels.gemv_routed): one launch for gate/up with SwiGLU
    into the activation rows, one for down into the output rows the combine reads, each block
    reading its expert's blocks where they lie. sources[e] is where expert e of the layer lies:
    ("resident", slot) or ("host", 0), the pinned host store read over PCIe; the executor
    turns them into the device table of blob addresses the kernels index by expert id. It
    stands for the layer's GatherRouted + Products per group (the same experts, the same
    rows), without group buffers and without a launch per group of 16 experts, so a step's
    work follows the top_k experts it routes; like them it is the same for every routed set,
    and a step still replays as one CUDA graph."""

    layer: int
    sources: tuple[Source, ...]
    stream: StreamName = "compute"

    def stands_for(self) -> list[Op]:
        """The layer's GatherRouted + Products per group that this op replaces (what the
        numpy executor runs for it)."""
        groups = range(-(-len(self.sources) // MMQ_GROUP))
        return [op for g in groups for op in routed_group(self.layer, g, self.sources)]


def routed_group(layer: int, group: int, sources: Sequence[Source]) -> list[Op]:
    """Group `group`'s GatherRouted (members read from `sources`, a layer's source per
    expert) and its Products on the first lane: a decode plan's group without gemv."""
    first = group * MMQ_GROUP
    experts = range(first, min(first + MMQ_GROUP, len(sources)))
    members = tuple(Gather(group, e - first, layer, e, sources[e]) for e in experts)
    return [GatherRouted(group, members), Products(layer, group, tuple(experts))]


@dataclass(frozen=True)
class Consume:
    """Host bookkeeping: the issuer may reuse the slots of entries <= entry."""

    entry: int
    stream: StreamName = field(default="host", init=False)


#: what a ChunkInput brings: "hidden", float32 [T, hidden] hidden states (MoE layers alone, or
#: a whole model's embedding rows decoded on the host), or "tokens", a whole model's T token
#: ids, whose embedding rows the executor looks up itself (the CUDA executor uploads T int32
#: and decodes the rows on the GPU from the embedding it keeps in its GGUF type)
InputKind = Literal["hidden", "tokens"]
INPUT_KINDS: tuple[InputKind, ...] = ("hidden", "tokens")


@dataclass(frozen=True)
class ChunkInput:
    """The chunk's input reaches the device and becomes its hidden states (`kind`: see
    InputKind). Every plan holds it once, in its first layer, before any op that reads the
    hidden states (the checker refuses a LayerBegin or Attention ahead of it, and token ids in
    a plan whose first layer opens without an Attention: only a whole model has an
    embedding). Executors take the input at begin_chunk; the CUDA executor's upload waits
    here, on the device, for its host pass over the input (the finite check and the copy into
    pinned memory, or the ids' range check and copy), so a walk's copy stream starts streaming
    experts while the host still works on the input; token ids are then looked up on the
    compute stream, writing the residual as the upload of hidden states would."""

    kind: InputKind = "hidden"
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class PromptRows:
    """A layer pass (planner.plan_layer_pass) runs each layer over every chunk of a prompt
    before the next layer, so its executor holds the residual of all the prompt's rows: the
    compute ops after this one act on rows [first, first + tokens) of the prompt (the next
    chunk: its ChunkInput, Attention, routing, products, combine, Logits) until the next
    PromptRows. Routing is per chunk (a LayerBegin routes the chunk's rows again)."""

    first: int
    tokens: int
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class LayerBegin:
    """RMSNorm, router logits, softmax top-k, counting sort, activation quantize."""

    layer: int
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class LayerEnd:
    """Combine the expert outputs with the router weights, residual add."""

    layer: int
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class Attention:
    """Self-attention of `layer` over the chunk and the KV cache before it, residual added.
    `start` is the absolute position of the chunk's first token, or None: the position the
    executor was given for the chunk (begin_chunk), which the GPU reads from device memory, so
    one captured decode step replays at every position; `dense_slot` the dense ring slot
    holding the layer's weights (None: they are resident)."""

    layer: int
    start: int | None
    dense_slot: int | None = None
    stream: StreamName = field(default="compute", init=False)


@dataclass(frozen=True)
class DenseCopy:
    """Copy layer `layer`'s dense slot from the host into dense ring slot `slot`."""

    layer: int
    slot: int
    stream: StreamName = field(default="copy", init=False)


@dataclass(frozen=True)
class HandOff:
    """A layer split's boundary (strata_rt.schedule.split): part `dst` copies the residual
    [tokens, hidden] and the chunk's start position from part `src` (the part before it), whose
    layers end at `boundary`. It takes the place of ChunkInput in the receiver's plan: the
    receiver's compute stream first waits for handoff_ready(boundary), recorded by the sender
    after its last LayerEnd, and records handoff_taken(boundary) after the copy, which the
    sender waits for before its next chunk overwrites the residual (a pull: the sender never
    waits on the receiver within a chunk)."""

    boundary: int
    src: int
    dst: int
    stream: StreamName = field(default="compute", init=False)


#: Logits rows: the chunk's last position only, every position, or the last position's greedy
#: token only (its argmax, where the backend can take it without bringing the row back)
LogitRows = Literal["last", "all", "argmax"]


@dataclass(frozen=True)
class Logits:
    """Final RMSNorm and output head over the chunk's last row or all of its rows."""

    rows: LogitRows
    stream: StreamName = field(default="compute", init=False)


Op = (Copy | Record | Wait | Gather | GatherBatch | GatherRouted | Products | LayerProducts
      | RoutedExperts | Consume | ChunkInput | LayerBegin | LayerEnd | Attention | DenseCopy
      | Logits | HandOff | RouteCopies | PromptRows)


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """mode "staging": layers planned one by one from the routed sets (chunks that route few
    experts, planner.takes_walk); mode "walk": the whole chunk planned up front,
    routing-independent; mode "routed_walk": the walk's schedule whose copies the routing
    switches on the device (only routed experts cross PCIe, on the copy engine); mode
    "decode": a one-token step of a whole model planned up front,
    its routed experts gathered straight from where they live, or multiplied there by
    RoutedExperts (planner.plan_decode); mode
    "routed": a prefill chunk planned the decode way, so only its routed experts cross PCIe
    (planner.plan_routed); mode "layer_pass": a prompt of several chunks run layer by layer,
    each layer over all its chunks while its streamed experts are in the ring (`tokens` is
    the prompt's; planner.plan_layer_pass)."""

    tokens: int
    mode: Literal["staging", "walk", "routed_walk", "decode", "routed", "layer_pass"]
    ring_slots: int
    layers: list[LayerPlan]

    def ops(self) -> Iterator[tuple[int, Op]]:
        """Every op of the chunk in host order with its index in that order."""
        i = 0
        for lp in self.layers:
            for op in lp.ops:
                yield i, op
                i += 1

    def count(self, kind: type) -> int:
        return sum(isinstance(op, kind) for lp in self.layers for op in lp.ops)
