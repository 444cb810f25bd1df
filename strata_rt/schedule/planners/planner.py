"""Planners: residency + ring state (+ the routed set on the staging ring) -> Plan.

Both planners share one builder, so the issuer/consumer rules of the streaming design live once:
- the issuer issues entry k (copy-stream Wait(used[slot]) when the slot held an earlier entry,
  Copy, Record(copied[slot])) only while k < consumed + ring_slots, and runs ahead as far as
  that allows every time `consumed` advances;
- the consumer waits `copied[slot]` on the compute stream before a gather reads the slot,
  records `used[slot]` after the launch that reads it, then advances `consumed`;
- batched gathers (native formats, gather_one False) collect the group's gathers and launch
  them at the end of the group. A batch holds its ring slots until it is launched, so when
  the consumer needs an entry the issuer cannot issue yet (the ring is full of slots the
  waiting batch holds) the batch is launched first (a flush). That is the design's "flush
  first" alternative to refusing to batch on a ring smaller than two groups: it can neither
  starve the issuer nor recycle a slot before the batch read it.

With two compute lanes (plan.LANES), group g is gathered and multiplied on lane g % 2: its
ring waits and `used` records go on that lane, and the layer forks and joins the lanes around
its products (schedule/plan.py says how).

A plan assumes its streams are idle at its start: executors synchronise at the end of every
chunk (the output is read back), so a chunk's entries restart at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..plan import (
    ChunkInput,
    ChunkPlan,
    InputKind,
    LayerBegin,
    LayerEnd,
    LayerPlan,
    Op,
    Products,
    RoutedExperts,
    routed_group,
)
from .ring_builder import RingBuilder, group_ring_entries, groups_of, resident_slots

if TYPE_CHECKING:
    from ...formats.contract import QuantFormat
    from ...weights.layer_formats import LayerFormats
    from ...weights.model import MoESpec
    from ..split import Part
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency
    from .dense_schedule import DenseSchedule

#: slots of the staging ring (chunks for which takes_walk is false)
STAGING_RING_SLOTS = 8
#: the walk is taken once this share of a layer's experts is expected to be routed
WALK_ROUTED_SHARE = 0.5
#: `prefill: auto` never picks a chunk longer than this (the models' native context). Larger
#: chunks stream the non-resident experts fewer times per prompt: a 30,118-token prompt on the
#: Qwen3-30B shape ran 839 / 649 / 643 ms at 8K / 16K / 32K chunks (bench/notes.md W5)
AUTO_CHUNK_MAX = 32768
#: the cap when the residency is derived from free VRAM (vram_reserve_mib): there the chunk is
#: sized first and resident experts take the rest, so a larger chunk would cost residents
RESERVE_AUTO_CHUNK_MAX = 8192
#: the walk's ring when a config gives no ring size (hundreds of MiB keep PCIe busy)
DEFAULT_RING_BYTES = 256 << 20


def takes_walk(tokens: int, spec: MoESpec, walk_min_tokens: int | None = None) -> bool:
    """Whether a chunk streams every non-resident expert (the walk) or only the routed ones
    (the staging ring). The ring reads the routed set back every layer and copies experts one
    slot at a time, so it only pays when few experts are routed. With uniform routing a layer
    routes an expected share 1 - (1 - top_k/n_experts)**tokens of its experts: for top-8 of
    128 that passes one half at 11 tokens and is ~100% at 254, where the ring would copy the
    same bytes as the walk at half the PCIe rate (measured on an H200, bench/notes.md). A
    fixed walk_min_tokens (STRATA_WALK_MIN_TOKENS) overrides the rule."""
    if walk_min_tokens is not None:
        return tokens >= walk_min_tokens
    share = 1.0 - (1.0 - spec.top_k / spec.n_experts) ** tokens
    return share >= WALK_ROUTED_SHARE


def gathers_one_by_one(fmt: QuantFormat | LayerFormats, requested: bool | None) -> bool:
    """The gather mode a chunk runs in: one launch per expert when asked
    (STRATA_PREFILL_GATHER_ONE) and always for a non-native format, whose blobs are not plain
    byte ranges (a model's formats: any layer's); the engine therefore never asks such a format
    to batch. Read per chunk, so an
    in-process A/B takes effect on the next prompt."""
    return bool(requested) or not fmt.native


def walk_ring_slots(ring_bytes: int | None, slot_bytes: int, n_entries: int) -> int:
    """Ring slots of the streamed walk: ring_bytes // slot_bytes, no more than the chunk
    streams (a larger ring would only hold unused memory), at least one."""
    from ...errors import BudgetError

    nbytes = DEFAULT_RING_BYTES if ring_bytes is None else int(ring_bytes)
    slots = nbytes // slot_bytes
    if slots < 1:
        raise BudgetError(f"ring of {nbytes} bytes holds no expert slot of {slot_bytes} bytes; "
                          f"give the ring at least {slot_bytes} bytes")
    return max(1, min(slots, n_entries))


@dataclass(frozen=True)
class RingSizes:
    """Slots of the ring one device arena holds: the streamed walk cycles through `walk`,
    the staging ring through STAGING_RING_SLOTS; one region of `total` slots serves both."""

    walk: int
    total: int


def ring_sizes(ring_bytes: int | None, slot_bytes: int, n_streamed: int) -> RingSizes:
    """The one ring-size rule every backend and the config's budget check use: the walk's
    ring from `ring_bytes` (walk_ring_slots) for `n_streamed` non-resident experts, and room
    for the staging ring."""
    walk = walk_ring_slots(ring_bytes, slot_bytes, max(1, n_streamed))
    return RingSizes(walk, max(walk, STAGING_RING_SLOTS))


def plan_walk(spec: MoESpec, residency: Residency, ring_slots: int, gather_one: bool,
              tokens: int = 0, attention: DenseSchedule | None = None,
              images: ImageCache | None = None, lanes: int = 1,
              in_place: bool = False, part: Part | None = None,
              routed_copies: bool = False, copy_chains: int = 1) -> ChunkPlan:
    """The streamed walk: every non-resident expert of every layer, layer-major ascending,
    streamed through the ring; every expert of a layer is gathered (groups are ids
    [16g, 16g+16)) so the schedule does not depend on routing and experts without rows cost an
    early exit in the products. attention: a whole model's chunk (each layer opens with its
    Attention, and streamed dense weights with their copies), None for MoE layers alone.
    images: the engine's image cache; a group it holds is multiplied from its block, with no
    gather (its experts are resident, so no ring entry is involved). lanes: compute lanes the
    groups alternate over (1 or 2). in_place: a group of resident experts is multiplied from
    their slots, with no gather (strata_rt.schedule.vram.in_place decides per chunk). part: the
    layers of one device of a layer split (None: every layer), whose plan opens with the
    part's prologue and ends with its epilogue (strata_rt.schedule.split). routed_copies: a
    routed walk (plan.py), whose copies and gathers the layer's routing switches on the device,
    so only routed experts cross PCIe, while the schedule stays the same for every routing;
    copy_chains: the copy streams its copies go round-robin over (plan.COPY_CHAINS)."""
    span = _span(spec, part)
    need = group_ring_entries(residency, span, spec.n_experts) if routed_copies else 0
    if ring_slots < need:
        raise ValueError(f"ring_slots={ring_slots}: a routed walk gathers a group in one "
                         f"launch, and a group here streams {need} experts")
    b = RingBuilder(residency, ring_slots, gather_one, lanes, in_place, routed_copies,
                    copy_chains if routed_copies else 1)
    b.seq = [(layer, e) for layer in span for e in range(spec.n_experts)
             if residency.slot(layer, e) is None]
    if attention is not None:  # the first dense layers go before any expert
        b.ops.extend(attention.chunk_ops())
    b.issue_available()  # the copies do not wait for the chunk's input
    b.ops.extend(_prologue(part, attention))
    layers = []
    all_experts = list(range(spec.n_experts))
    for layer in span:
        if attention is not None:
            b.ops.extend(attention.layer_ops(layer))
        b.begin_layer(layer)
        for g, experts in enumerate(groups_of(all_experts)):
            b.group(layer, g, experts, None if images is None else images.index(layer, g))
        b.end_layer(layer)
        if layer == span[-1] and part is not None:
            b.ops.extend(part.epilogue())
        layers.append(LayerPlan(layer, b.take_ops()))
    return ChunkPlan(tokens, "routed_walk" if routed_copies else "walk", ring_slots, layers)


def _span(spec: MoESpec, part: Part | None) -> range:
    """The layers a plan covers: a split part's, else all of them."""
    return range(spec.n_layers) if part is None else part.layers


def _prologue(part: Part | None, attention: DenseSchedule | None) -> list[Op]:
    """What brings the chunk's hidden states in: ChunkInput (of the kind a whole model's
    schedule names: its token ids where the executor looks the embedding up), or a split
    part's hand-off."""
    kind: InputKind = "hidden" if attention is None else attention.input_kind
    return [ChunkInput(kind)] if part is None else part.prologue(kind)


def plan_decode(spec: MoESpec, residency: Residency, attention: DenseSchedule,
                in_place: bool = False, part: Part | None = None,
                gemv: bool = False) -> ChunkPlan:
    """A whole model's one-token step with the routed set kept on the device: per layer its
    Attention (dense copies as `attention` schedules them; its start None, so the position is
    read on the device), the routing, one GatherRouted per group of 16 experts (resident ones
    from their slots, the rest straight from the host store; experts without a row skipped on
    the device) and the products, which exit early for experts without rows. No Copy and no
    expert ring: the plan is the same at every position and for every routed set, so one
    captured replay serves every step, where the staging ring reads each layer's routed set
    back to the host and plans after it. in_place: a group whose experts are all resident
    gathers nothing; its products read the routed experts' slots in place. part: as for
    plan_walk (the hand-off brings the position with the residual). gemv: each layer's
    experts run as one RoutedExperts (matrix-vector launches over the routed pairs, reading
    every expert where it lies) in place of the groups' gathers and products."""
    if attention.start is not None:
        raise ValueError(f"a decode plan reads its position on the device; the dense schedule "
                         f"fixes start {attention.start}")
    return _routed_layers(spec, residency, attention, in_place, 1, "decode", part, gemv)


def plan_routed(spec: MoESpec, residency: Residency, attention: DenseSchedule | None,
                in_place: bool, tokens: int, part: Part | None = None) -> ChunkPlan:
    """A prefill chunk streamed the decode plan's way (mode "routed"): no Copy and no ring; each
    group's GatherRouted reads the routed non-resident experts straight from the pinned host
    store and skips the experts the chunk's routing gave no rows, on the device. Only what the
    chunk routes crosses PCIe, without the host waiting for any layer's routing; the price is
    that those reads run on the compute lane instead of beside it (the driver's
    `prefill_stream` rule weighs the two). part: as for plan_walk."""
    return _routed_layers(spec, residency, attention, in_place, tokens, "routed", part)


def _routed_layers(spec: MoESpec, residency: Residency, attention: DenseSchedule | None,
                   in_place: bool, tokens: int, mode: Literal["decode", "routed"],
                   part: Part | None, gemv: bool = False) -> ChunkPlan:
    ops: list[Op] = [*attention.chunk_ops()] if attention is not None else []
    ops += _prologue(part, attention)
    layers = []
    span = _span(spec, part)
    for layer in span:
        if attention is not None:
            ops += attention.layer_ops(layer)
        ops.append(LayerBegin(layer))
        sources = tuple(residency.source(layer, e) for e in range(spec.n_experts))
        if gemv:
            ops.append(RoutedExperts(layer, sources))
        for g, experts in enumerate([] if gemv else groups_of(list(range(spec.n_experts)))):
            slots = resident_slots(residency, layer, experts) if in_place else None
            if slots is not None:
                ops.append(Products(layer, g, tuple(experts), slots=slots))
            else:
                ops += routed_group(layer, g, sources)
        ops.append(LayerEnd(layer))
        if layer == span[-1] and part is not None:
            ops += part.epilogue()
        layers.append(LayerPlan(layer, tuple(ops)))
        ops = []
    return ChunkPlan(tokens, mode, 0, layers)


class StagingPlanner:
    """The staging ring for small chunks: after a layer's routing is known, its routed
    non-resident experts stream through an 8-slot ring; ring state carries across layers.
    One planner per chunk; attention, lanes, in_place and part as for plan_walk (the driver runs a
    layer's `pre_routing_ops` before its routing; the layer's plan records them first)."""

    def __init__(self, spec: MoESpec, residency: Residency, gather_one: bool,
                 ring_slots: int = STAGING_RING_SLOTS, tokens: int = 0,
                 attention: DenseSchedule | None = None, lanes: int = 1,
                 in_place: bool = False, part: Part | None = None):
        self.spec = spec
        self.part = part
        self.span = _span(spec, part)
        self.tokens = tokens
        self.attention = attention
        self._b = RingBuilder(residency, ring_slots, gather_one, lanes, in_place)
        self.layers: list[LayerPlan] = []
        self._opened: set[int] = set()  # layers whose pre-routing ops are planned

    def pre_routing_ops(self, layer: int) -> list[Op]:
        """The ops a layer runs before its routing; they open the layer's plan. The first
        layer's begin with the chunk's input (and a whole model's first dense copies); a whole
        model's layer then runs its Attention. plan_layer plans them itself when they were
        not asked for."""
        self._opened.add(layer)
        ops: list[Op] = []
        if layer == self.span[0] and self.attention is not None:
            ops += self.attention.chunk_ops()
        if layer == self.span[0]:
            ops += _prologue(self.part, self.attention)
        if self.attention is not None:
            ops += self.attention.layer_ops(layer)
        self._b.ops.extend(ops)
        return ops

    def plan_layer(self, layer: int, routed_experts: Sequence[int]) -> LayerPlan:
        """routed_experts: the experts with at least one row in this layer (any order)."""
        experts = sorted({int(e) for e in routed_experts})
        bad = [e for e in experts if not 0 <= e < self.spec.n_experts]
        if bad:
            raise ValueError(f"layer {layer}: routed expert ids {bad} outside "
                             f"0..{self.spec.n_experts - 1}")
        if layer not in self._opened:
            self.pre_routing_ops(layer)
        b = self._b
        b.seq.extend((layer, e) for e in experts if b.residency.slot(layer, e) is None)
        b.begin_layer(layer)
        b.issue_available()
        for g, group in enumerate(groups_of(experts)):
            b.group(layer, g, group)
        b.end_layer(layer)
        if layer == self.span[-1] and self.part is not None:
            b.ops.extend(self.part.epilogue())
        lp = LayerPlan(layer, b.take_ops())
        self.layers.append(lp)
        return lp

    def chunk_plan(self) -> ChunkPlan:
        """The layers planned so far as one chunk plan (for the checker and the counters)."""
        return ChunkPlan(self.tokens, "staging", self._b.ring, list(self.layers))
