"""The reference backend: runs the engine's plans op by op with numpy, on the CPU.

It is slow on purpose and literal: ring slots, resident slots and group buffers are real byte
arrays; a Copy moves a blob from the host store into a ring slot; a gather copies the format's
images out of the slot it names; Products reads the group buffers through the format's own
numpy MMQ reference. A plan that reads a slot before its copy, or a position nobody gathered,
gives wrong numbers here too, so this backend also tests what the planners emit.

Arithmetic: routing in float32 (RMSNorm, router logits, softmax, top-k with ties to the lower
id, renormalised weights); gate/up and down through `fmt.mmq_reference` on activations from
`fmt.prepare_activations` (a RoutedExperts or LayerProducts: its groups' products); SwiGLU in
float32, re-quantized for down; the combine in float32 in top-k order (descending
probability); residual add in float32. Every RMSNorm's input is checked first (NaN, infinity, or a mean
square that overflows and would normalise the row to zeros), and so are the router's softmax
and the residual after each attention and MoE block: a value that left float32's range is a
NonFiniteError naming the layer and the row.

Memory: without `expert_cache` the reference backend keeps no expert resident (it has no VRAM
to measure), so every expert streams. The image cache (`image_cache_mib`) is host arrays here,
filled at open through the same gather, so cached plans run here too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ...formats.contract import MMQ_GROUP
from ...host.host_copy import all_finite
from ...models.qwen3.whole_memory import DenseTypes, embeds_on_gpu
from ...report.stats import Stats
from ...report.timing import format_table
from ...schedule.plan import (
    HOST,
    RESIDENT,
    Attention,
    ChunkInput,
    Consume,
    Copy,
    DenseCopy,
    Gather,
    GatherBatch,
    GatherRouted,
    HandOff,
    InputKind,
    LayerBegin,
    LayerEnd,
    LayerProducts,
    Logits,
    Op,
    Products,
    PromptRows,
    Record,
    RouteCopies,
    RoutedExperts,
    Wait,
    lane_index,
)
from ...schedule.planners.dense_schedule import DENSE_RING_SLOTS
from ...schedule.planners.planner import ring_sizes
from ...schedule.vram.image_cache import ImageCache, capacity_blocks
from ...schedule.vram.in_place import check_in_place, chunk_in_place
from ...schedule.vram.lanes import allocated_lanes, chunk_lanes
from ...schedule.vram.residency import Residency
from ...weights.model import rms_norm
from ...weights.store import ExpertStore
from ..cuda.chunk_input import chunk_token_ids, input_not_finite
from ..cuda.routing.exact import route_exact
from ..nonfinite import NonFiniteError, check_finite, check_rms_input
from .attention import ReferenceDense
from .context import NumpyContext
from .layer_state import LayerState

if TYPE_CHECKING:
    from ...config.settings.engine_config import EngineConfig
    from ...models.qwen3.weights import Qwen3Model
    from ...schedule.executor import HostContext, Replay
    from ...schedule.split import Part
    from ...weights.model import Model

_POISON = 0xFF


class ReferenceBackend:
    name = "reference"
    context_class = NumpyContext
    #: everything runs on the host, so host time is the wall time
    host_is_wall = True
    can_capture = False
    routed_copies = True  # RouteCopies switches the copies of a routed walk (in host order)
    #: a whole model sets these at open (see schedule.executor: Executor and Backend)
    dense_ring: int | None = None
    kv_capacity = 0
    #: GatherRouted reads the routing of its layer (a decode step's plan runs here too)
    routed_gathers = True

    def __init__(self, model: Model, store: ExpertStore, residency: Residency | None,
                 cfg: EngineConfig, context: HostContext | None = None,
                 whole: Qwen3Model | None = None, part: Part | None = None):
        self.model, self.store, self.cfg = model, store, cfg
        #: the layers this executor runs (a layer split's part; None: all) and, in a split,
        #: every part's executor by part index (a HandOff copies from its sender's)
        self.part = part
        self.peers: list[ReferenceBackend] = []
        first = 0 if part is None else part.first
        #: a whole model's attention, KV cache and head (None: MoE layers alone)
        self.dense = (ReferenceDense(whole, cfg.context, first) if whole is not None
                      else None)
        #: "tokens": a whole model's chunks bring token ids, decoded at ChunkInput (decided as
        #: the CUDA backend decides it, so both run the same plans); else "hidden"
        self.input_kind: InputKind = "tokens" if (
            whole is not None and first == 0 and embeds_on_gpu(
                cfg.embedding or "auto", whole.dense.token_embd.type_name,
                DenseTypes.of_model(whole).tied and (part is None or part.last))) else "hidden"
        self._ids = np.empty(0, np.int32)
        if self.dense is not None:
            self.kv_capacity = self.dense.kv_capacity
        #: prompt rows a layer pass may hold (host arrays: as many as the KV cache's positions)
        self.pass_tokens = self.kv_capacity
        self._row0 = 0  # the first prompt row of the chunk the ops act on (a layer pass's)
        #: dense ring slots when cfg.dense is "stream" (the plan's DenseCopy ops are then
        #: checked here: an Attention must find its layer in its slot); None: resident
        self.dense_ring = DENSE_RING_SLOTS if cfg.dense == "stream" else None
        self._dense_slots: dict[int, int] = {}
        self._start: int | None = None
        #: the position begin_chunk was given (what an Attention without a start reads)
        self._chunk_start: int | None = None
        self._logits: np.ndarray | None = None
        self.spec, self.fmt, self.lay = model.spec, model.fmt, model.layout
        self.formats = model.formats
        self.layer_blob_bytes = tuple(lay.blob_bytes for lay in model.formats.layouts)
        self.residency = residency if residency is not None else Residency.from_budget(
            model, 0)
        self.timing = bool(cfg.timing)
        slot = store.slot_bytes
        self.resident = np.empty((self.residency.n_slots, slot), dtype=np.uint8)
        for i, (layer, e) in enumerate(self.residency.pairs):
            self.resident[i] = store.arena[store.offset(layer, e): store.offset(layer, e) + slot]
        n_layers = self.spec.n_layers if part is None else part.end - part.first
        rings = ring_sizes(cfg.ring_bytes, slot,
                           n_layers * self.spec.n_experts - self.residency.n_slots)
        self.walk_slots = rings.walk
        self.ring = np.full((rings.total, slot), _POISON, np.uint8)
        self._switch: dict[int, bool] = {}  # a routed walk's entry -> its copy is on
        #: group buffers of each compute lane (plan.LANES): lane i gathers into set i
        self.lanes = allocated_lanes(cfg.compute_lanes or "auto", self.residency.n_slots
                                     >= self.spec.total_experts)
        self.in_place = check_in_place(cfg.in_place, model.formats.in_place_format)
        self.gu_bufs = np.full((self.lanes, MMQ_GROUP, self.lay.gate_up_image_bytes), _POISON,
                               np.uint8)
        self.dn_bufs = np.full((self.lanes, MMQ_GROUP, self.lay.down_image_bytes), _POISON,
                               np.uint8)
        self.images = ImageCache.choose(self.spec, self.residency, capacity_blocks(
            cfg.image_cache_mib, self.spec, self.lay))
        if cfg.image_cache_mib:
            self.images.report(self.spec, self.lay)
        n_blocks = len(self.images.blocks)
        self.image_gu = np.full((n_blocks, *self.gu_bufs.shape[1:]), _POISON, np.uint8)
        self.image_dn = np.full((n_blocks, *self.dn_bufs.shape[1:]), _POISON, np.uint8)
        for b, pos, slot in self.images.fills(self.spec, self.residency):
            layer = self.residency.pairs[slot][0]
            self.image_gu[b, pos], self.image_dn[b, pos] = self._images(self.resident[slot],
                                                                        layer)
        self._state: LayerState | None = None
        self._h = np.empty((0, self.spec.hidden), np.float32)
        self._stats = Stats()
        #: top-k ids per layer of the last chunk (comparisons against reference_moe_f64)
        self.routes: list[np.ndarray] = []

    # ------------------------------------------------------------------ chunk (Executor)
    def begin_chunk(self, x: np.ndarray, stats: Stats, start: int | None = None) -> None:
        """x: hidden states [T, hidden], or (input_kind "tokens") T token ids, range-checked
        here and decoded at the plan's ChunkInput (the residual is NaN until then, so a plan
        that reads it first fails loudly)."""
        if self.input_kind == "tokens":
            self._ids = chunk_token_ids(x, self._whole().spec.vocab)
            x = np.full((self._ids.size, self.spec.hidden), np.nan, np.float32)
        elif not all_finite(x):
            raise input_not_finite()
        self._h = np.array(x, dtype=np.float32, copy=True)
        self._state = None
        self._stats = stats
        self.routes = []
        self._start = self._logits = None
        self._chunk_start = start
        self._row0 = 0

    def begin_pass(self, x: np.ndarray, stats: Stats, start: int) -> None:
        """A layer pass over a whole model's prompt of len(x) rows at position `start`: the
        residual holds them all; the plan's PromptRows pick the rows each op acts on."""
        if self.dense is None:
            raise TypeError("a layer pass needs a whole model; this backend runs MoE layers "
                            "alone")
        self.begin_chunk(x, stats, start)
        self.dense.reserve(start, int(x.shape[0]))
        self._start = start

    def begin_received(self, tokens: int, stats: Stats) -> None:
        """A split part's chunk: its residual and position arrive with the plan's HandOff;
        until then the residual is NaN, so a plan that reads it first fails loudly."""
        self.begin_chunk(np.zeros((tokens, self.spec.hidden), np.float32), stats)
        self._h[...] = np.nan

    def route_layer(self, layer: int) -> None:
        self._begin(layer, self._h, self._stats)

    def routed_counts(self, layer: int, stats: Stats) -> np.ndarray:
        assert self._state is not None and self._state.layer == layer
        return np.diff(self._state.bounds)

    def execute(self, ops: Iterable[Op], stats: Stats, counts: np.ndarray | None) -> None:
        # the ops act on every row until a PromptRows picks a chunk's (a pass's Logits after
        # its layers reads the prompt's rows, numbered from its first)
        self._row0 = 0
        self._execute(ops, self._h, stats)

    def lanes_for(self, tokens: int) -> int:
        return chunk_lanes(self.lanes, tokens, self.spec)

    def in_place_for(self, tokens: int) -> bool:
        return chunk_in_place(self.in_place, self.formats.in_place_format, tokens, self.spec)

    def capture(self, ops: Iterable[Op]) -> NoReturn:
        raise NotImplementedError("the reference backend replays nothing")

    def replay(self, replay: Replay) -> None:
        raise NotImplementedError("the reference backend replays nothing")

    def synchronize(self) -> None:
        pass

    def collect_walk_routing(self, stats: Stats) -> None:
        pass  # each layer's routing was added as it ran

    def end_chunk(self, stats: Stats, output: bool = True) -> np.ndarray:
        """The residual itself (no copy is made, so `output` changes nothing here)."""
        if self.timing and stats.chunk_index == stats.n_chunks - 1:
            stats.phase_table = ("reference backend: host seconds per phase, not GPU time\n"
                                 + format_table({p: s * 1e3 for p, s in stats.phase_s.items()}))
        if self.dense is not None and self._start is not None:
            self.dense.end_chunk(self._start, self._h.shape[0])
        return self._h

    def take_logits(self) -> np.ndarray:
        if self._logits is None:
            raise RuntimeError("no Logits op ran in this chunk")
        return self._logits

    # ------------------------------------------------------------------ ops
    def _execute(self, ops: Iterable[Op], h: np.ndarray, stats: Stats) -> None:
        # out-of-range values are refused by each step's checks, not numpy's warnings
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                self._execute_ops(ops, h, stats)
        except NonFiniteError as e:  # a layer pass's chunk names its rows from its first
            raise (e.shifted(self._row0) if self._row0 else e) from None

    def _execute_ops(self, ops: Iterable[Op], h: np.ndarray, stats: Stats) -> None:
        for op in ops:
            t0 = time.perf_counter()
            if isinstance(op, Copy):
                self._copy(op)
                phase = "copy"
            elif isinstance(op, RouteCopies):  # the layer's switches, from its routing
                bounds = self._layer_state(op.layer, "RouteCopies").bounds
                self._switch.update((k, bool(bounds[e + 1] > bounds[e])) for k, e in op.copies)
                continue
            elif isinstance(op, Gather):
                self._gather(op)
                phase = "gather"
            elif isinstance(op, GatherBatch):
                for g in op.gathers:
                    self._gather(g)
                phase = "gather"
            elif isinstance(op, GatherRouted):
                self._gather_routed(op)
                phase = "gather"
            elif isinstance(op, Products):
                self._products(op)
                phase = "products"
            elif isinstance(op, RoutedExperts | LayerProducts):  # the same experts and rows,
                self._execute_ops(op.stands_for(), h, stats)  # group by group
                continue
            elif isinstance(op, LayerBegin):
                if self._state is None or self._state.layer != op.layer:
                    self._begin(op.layer, h, stats)
                continue
            elif isinstance(op, LayerEnd):
                self._combine(h)
                phase = "combine"
            elif isinstance(op, DenseCopy):
                self._dense_slots[op.slot] = op.layer
                continue
            elif isinstance(op, Attention):
                if op.dense_slot is not None and self._dense_slots.get(op.dense_slot) != op.layer:
                    raise RuntimeError(f"Attention of layer {op.layer} reads dense slot "
                                       f"{op.dense_slot}, which holds layer "
                                       f"{self._dense_slots.get(op.dense_slot)}")
                start = op.start if op.start is not None else self._chunk_start
                if start is None:
                    raise RuntimeError(f"Attention of layer {op.layer} reads the chunk's "
                                       "position, but begin_chunk was given none")
                check_rms_input(h, "the RMSNorm before attention", op.layer)
                self._whole().attention(op.layer, h, start)
                check_finite(h, "the residual after attention", op.layer)
                self._start = start - self._row0  # the prompt's (a layer pass's chunk's - row)
                phase = "attention"
            elif isinstance(op, Logits):
                rows = None if op.rows == "all" else np.array([h.shape[0] - 1])
                check_rms_input(h if rows is None else h[-1:], "the final RMSNorm", None, rows)
                self._logits = self._whole().logits(h, op.rows)
                phase = "logits"
            elif isinstance(op, HandOff):
                self._receive(op, h)
                phase = "handoff"
            elif isinstance(op, ChunkInput):  # begin_chunk took hidden states; ids: rows
                if op.kind != self.input_kind:
                    raise RuntimeError(f"{op!r} in the plan of an executor whose chunks bring "
                                       f"{self.input_kind!r} input")
                if op.kind == "tokens":
                    h[...] = self._whole().embed(self._ids[self._row0: self._row0 + len(h)])
                continue
            elif isinstance(op, PromptRows):  # a layer pass's next chunk: its rows, routed anew
                if op.first + op.tokens > self._h.shape[0]:
                    raise RuntimeError(f"{op!r} past the prompt's {self._h.shape[0]} rows")
                h, self._row0, self._state = self._h[op.first: op.first + op.tokens], op.first, None
                continue
            elif isinstance(op, Record | Wait | Consume):
                continue  # one thread runs every op in host order: nothing left to order
            else:
                raise TypeError(f"unknown plan op {op!r}")
            stats.phase_s[phase] += time.perf_counter() - t0

    def _receive(self, op: HandOff, h: np.ndarray) -> None:
        """The sender's residual into this part's (in place: the ops hold `h`), and the
        chunk's position, which the receiver's Attention ops read."""
        if not 0 <= op.src < len(self.peers) or self.peers[op.dst] is not self:
            raise RuntimeError(f"{op!r}: this executor is not part {op.dst} of a split whose "
                               f"part {op.src} it can read")
        sender = self.peers[op.src]
        if sender._h.shape != h.shape:
            raise RuntimeError(f"{op!r}: the sender holds {sender._h.shape[0]} rows, this "
                               f"chunk {h.shape[0]}")
        h[...] = sender._h
        self._chunk_start = sender._chunk_start

    def _whole(self) -> ReferenceDense:
        if self.dense is None:
            raise TypeError("an Attention or Logits op needs a whole model; this backend runs "
                            "MoE layers alone")
        return self.dense

    def _begin(self, layer: int, h: np.ndarray, stats: Stats) -> None:
        t0 = time.perf_counter()
        spec = self.spec
        check_rms_input(h, "the RMSNorm before the MoE", layer)
        with np.errstate(over="ignore", invalid="ignore"):  # a non-finite route is refused
            xn = rms_norm(h, self.model.norm[layer], spec.rms_eps)
            ids, w = route_exact(xn, self.model.router[layer], spec.top_k)
        check_finite(w, "the router's softmax (its logits overflow float32 or are NaN)", layer)
        stats.add_routing(layer, ids, spec.n_experts)
        self.routes.append(ids)
        self._state = LayerState(layer, xn, ids, w, spec.n_experts, spec.hidden)
        stats.phase_s["route"] += time.perf_counter() - t0

    def _layer_state(self, layer: int, what: str) -> LayerState:
        if self._state is None or self._state.layer != layer:
            raise RuntimeError(f"{what} of layer {layer} outside its layer")
        return self._state

    def _copy(self, op: Copy) -> None:
        """A routed copy that its RouteCopies switched off copies nothing; its slot is
        poisoned instead, so a launch that still read it would change the output."""
        if op.routed and not self._switch.pop(op.entry):
            self.ring[op.slot] = _POISON
            return
        blob = self.store.view(op.layer, op.expert)
        self.ring[op.slot, : blob.size] = blob

    def _gather_routed(self, op: GatherRouted) -> None:
        """The members whose expert has rows in the layer's routing, as the GPU kernel skips
        the others on the device."""
        st = self._layer_state(op.gathers[0].layer, f"GatherRouted of group {op.group}")
        for g in op.gathers:
            if st.bounds[g.expert + 1] > st.bounds[g.expert]:
                self._gather(g)

    def _gather(self, g: Gather) -> None:
        kind, idx = g.src
        if kind == HOST:
            off = self.store.offset(g.layer, g.expert)
            src = self.store.arena[off: off + self.store.slot_bytes]
        else:
            src = self.resident[idx] if kind == RESIDENT else self.ring[idx]
        gu, dn = self._images(src, g.layer)
        self.gu_bufs[lane_index(g.stream), g.pos] = gu
        self.dn_bufs[lane_index(g.stream), g.pos] = dn

    def _products(self, op: Products) -> None:
        st, fmt, spec = self._state, self.formats.format(op.layer), self.spec
        if st is None or st.layer != op.layer:
            raise RuntimeError(f"Products of layer {op.layer} outside its layer")
        if not st.has_rows(op.expert_ids):
            return  # every expert of the group has no rows: the kernels exit early
        lane = lane_index(op.stream)
        if op.slots is not None:  # read in place: each expert's images from its resident slot
            gu_buf, dn_buf = self._slot_images(op.slots, op.layer)
        elif op.cached is not None:
            gu_buf, dn_buf = self.image_gu[op.cached], self.image_dn[op.cached]
        else:
            gu_buf, dn_buf = self.gu_bufs[lane], self.dn_bufs[lane]
        st.multiply(op.expert_ids, fmt, gu_buf, dn_buf, spec.ffn)

    def _images(self, slot: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer format's images of the blob a slot holds (what its gather writes)."""
        nbytes = self.formats.layout(layer).blob_bytes
        return self.formats.format(layer).images(slot[:nbytes], self.spec.hidden,
                                                 self.spec.ffn)

    def _slot_images(self, slots: tuple[int, ...], layer: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The images the products see of resident slots read in place (as gathered)."""
        parts = [self._images(self.resident[s], layer) for s in slots]
        return np.stack([gu for gu, _ in parts]), np.stack([dn for _, dn in parts])

    def _combine(self, h: np.ndarray) -> None:
        if self._state is None:
            raise RuntimeError("LayerEnd before any LayerBegin")
        self._state.combine(h)

    def close(self) -> None:
        """Drops the slot and group buffers (the engine never calls a closed backend)."""
        empty = np.empty((0, 0), np.uint8)
        self.resident = self.ring = empty
        self.gu_bufs = self.dn_bufs = np.empty((0, 0, 0), np.uint8)
        self.image_gu = self.image_dn = np.empty((0, 0, 0), np.uint8)
