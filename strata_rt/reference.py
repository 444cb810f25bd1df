"""The reference backend: runs the engine's plans op by op with numpy, on the CPU.

It is slow on purpose and literal: ring slots, resident slots and group buffers are real byte
arrays; a Copy moves a blob from the host store into a ring slot; a gather copies the format's
images out of the slot it names; Products reads the group buffers through the format's own
numpy MMQ reference. A plan that reads a slot before its copy, or a position nobody gathered,
gives wrong numbers here too, so this backend also tests what the planners emit.

Arithmetic: routing in float32 (RMSNorm, router logits, softmax, top-k with ties to the lower
id, renormalised weights); gate/up and down through `fmt.mmq_reference` on activations from
`fmt.prepare_activations`; SwiGLU in float32, re-quantized for down; the combine in float32 in
top-k order (descending probability); residual add in float32.

Memory: without `expert_cache` the reference backend keeps no expert resident (it has no VRAM
to measure), so every expert streams.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

import numpy as np

from . import hazards
from .formats import MMQ_GROUP
from .model import rms_norm, route, silu
from .plan import (
    RESIDENT,
    ChunkPlan,
    Consume,
    Copy,
    Gather,
    GatherBatch,
    LayerBegin,
    LayerEnd,
    Op,
    Products,
    Record,
    Wait,
)
from .planner import (
    STAGING_RING_SLOTS,
    StagingPlanner,
    gathers_one_by_one,
    plan_walk,
    takes_walk,
    walk_ring_slots,
)
from .residency import Residency
from .store import numpy_alloc
from .timing import format_table

_POISON = 0xFF


class _LayerState:
    """One layer's routing and buffers, sorted by expert (row r of the sorted order is the
    (token, k) pair order[r]; expert e owns rows bounds[e]..bounds[e+1]-1)."""

    def __init__(self, layer: int, xn: np.ndarray, ids: np.ndarray, w: np.ndarray,
                 n_experts: int, hidden: int):
        self.layer = layer
        self.ids, self.w = ids, w
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        self.order = np.argsort(flat, kind="stable")
        self.bounds = np.zeros(n_experts + 1, dtype=np.int32)
        self.bounds[1:] = np.cumsum(np.bincount(flat, minlength=n_experts))
        self.x_sorted = xn[self.order // top_k]
        self.out_sorted = np.zeros((flat.size, hidden), dtype=np.float32)
        self.routed = np.nonzero(np.diff(self.bounds))[0].tolist()


class ReferenceBackend:
    name = "reference"
    host_alloc = staticmethod(numpy_alloc)

    def __init__(self, model, store, residency: Residency | None, cfg):
        self.model, self.store, self.cfg = model, store, cfg
        self.spec, self.fmt, self.lay = model.spec, model.fmt, model.layout
        self.residency = residency if residency is not None else Residency.from_budget(
            model, 0)
        self.check_plan = bool(cfg.check_plan)
        self.timing = bool(cfg.timing)
        slot = store.slot_bytes
        self.resident = np.empty((self.residency.n_slots, slot), dtype=np.uint8)
        for i, (layer, e) in enumerate(self.residency.pairs):
            self.resident[i] = store.arena[store.offset(layer, e): store.offset(layer, e) + slot]
        self.n_streamed = self.spec.total_experts - self.residency.n_slots
        self.walk_slots = walk_ring_slots(cfg.ring_bytes, slot, max(1, self.n_streamed))
        self.ring = np.full((max(self.walk_slots, STAGING_RING_SLOTS), slot), _POISON, np.uint8)
        self.gu_buf = np.full((MMQ_GROUP, self.lay.gate_up_image_bytes), _POISON, np.uint8)
        self.dn_buf = np.full((MMQ_GROUP, self.lay.down_image_bytes), _POISON, np.uint8)
        self.last_plan: ChunkPlan | None = None
        #: top-k ids per layer of the last chunk (comparisons against reference_moe_f64)
        self.routes: list[np.ndarray] = []

    @property
    def gather_one(self) -> bool:
        return gathers_one_by_one(self.fmt, self.cfg.gather_one)

    # ------------------------------------------------------------------ chunk
    def run_chunk(self, h: np.ndarray, stats) -> np.ndarray:
        spec = self.spec
        h = np.array(h, dtype=np.float32, copy=True)
        self._state: _LayerState | None = None
        self.routes = []
        if not takes_walk(h.shape[0], spec, self.cfg.walk_min_tokens):
            planner = StagingPlanner(spec, self.residency, self.gather_one, tokens=h.shape[0])
            checker = (hazards.Checker(STAGING_RING_SLOTS, self.residency)
                       if self.check_plan else None)
            for layer in range(spec.n_layers):
                self._begin(layer, h, stats)
                stats.host_syncs += 1  # the routed set comes back to the host
                lp = planner.plan_layer(layer, self._state.routed)
                if checker is not None:
                    checker.feed(lp.ops)
                self._execute(lp.ops, h, stats)
                stats.layer_done(layer)
            self.last_plan = planner.chunk_plan()
        else:
            plan = plan_walk(spec, self.residency, self.walk_slots, self.gather_one,
                             tokens=h.shape[0])
            if self.check_plan:
                hazards.check(plan, self.residency)
            for lp in plan.layers:
                self._execute(lp.ops, h, stats)
                stats.layer_done(lp.layer)
            self.last_plan = plan
        stats.host_syncs += 1  # the chunk's output comes back
        if self.timing and stats.chunk_index == stats.n_chunks - 1:
            print("reference backend: host seconds per phase, not GPU time", file=sys.stderr)
            print(format_table({p: s * 1e3 for p, s in stats.phase_s.items()}),
                  file=sys.stderr)
        return h

    # ------------------------------------------------------------------ ops
    def _execute(self, ops: Iterable[Op], h: np.ndarray, stats) -> None:
        for op in ops:
            t0 = time.perf_counter()
            if isinstance(op, Copy):
                blob = self.store.view(op.layer, op.expert)
                self.ring[op.slot, : blob.size] = blob
                stats.experts_streamed += 1
                stats.bytes_streamed += blob.size
                phase = "copy"
            elif isinstance(op, Gather):
                self._gather(op)
                stats.gathers_launched += 1
                phase = "gather"
            elif isinstance(op, GatherBatch):
                for g in op.gathers:
                    self._gather(g)
                stats.gathers_launched += 1
                phase = "gather"
            elif isinstance(op, Products):
                self._products(op)
                stats.mmq_launches += 2
                phase = "products"
            elif isinstance(op, LayerBegin):
                if self._state is None or self._state.layer != op.layer:
                    self._begin(op.layer, h, stats)
                continue
            elif isinstance(op, LayerEnd):
                self._combine(h)
                phase = "combine"
            elif isinstance(op, Record | Wait | Consume):
                # one thread runs every op in host order: a valid linearisation of any
                # schedule the checker accepts, so events have nothing left to order
                continue
            else:
                raise TypeError(f"unknown plan op {op!r}")
            stats.phase_s[phase] += time.perf_counter() - t0

    def _begin(self, layer: int, h: np.ndarray, stats) -> None:
        t0 = time.perf_counter()
        spec = self.spec
        xn = rms_norm(h, self.model.norm[layer], spec.rms_eps)
        ids, w = route(xn, self.model.router[layer], spec.top_k)
        stats.add_routing(layer, ids, spec.n_experts)
        self.routes.append(ids)
        self._state = _LayerState(layer, xn, ids, w, spec.n_experts, spec.hidden)
        stats.phase_s["route"] += time.perf_counter() - t0

    def _gather(self, g: Gather) -> None:
        kind, idx = g.src
        src = self.resident[idx] if kind == RESIDENT else self.ring[idx]
        gu, dn = self.fmt.images(src[: self.lay.blob_bytes], self.spec.hidden, self.spec.ffn)
        self.gu_buf[g.pos] = gu
        self.dn_buf[g.pos] = dn

    def _products(self, op: Products) -> None:
        st, fmt, spec = self._state, self.fmt, self.spec
        if st is None or st.layer != op.layer:
            raise RuntimeError(f"Products of layer {op.layer} outside its layer")
        ids = op.expert_ids
        n = len(ids)
        lo = min(int(st.bounds[e]) for e in ids)
        hi = max(int(st.bounds[e + 1]) for e in ids)
        if hi == lo:
            return  # every expert of the group has no rows: the kernels exit early
        # the group's rows lie in [lo, hi); activations are quantized per row, so quantizing
        # that slice equals slicing the whole layer's activations
        b = np.clip(st.bounds.astype(np.int64) - lo, 0, hi - lo).astype(np.int32)
        F = spec.ffn
        gu = fmt.mmq_reference(self.gu_buf[:n], ids, fmt.prepare_activations(st.x_sorted[lo:hi]),
                               b, 2 * F, spec.hidden)
        mid = np.zeros((hi - lo, F), dtype=np.float32)
        for e in ids:
            r0, r1 = int(b[e]), int(b[e + 1])
            mid[r0:r1] = silu(gu[r0:r1, :F]) * gu[r0:r1, F:]
        dn = fmt.mmq_reference(self.dn_buf[:n], ids, fmt.prepare_activations(mid), b,
                               spec.hidden, F)
        for e in ids:
            r0, r1 = int(b[e]), int(b[e + 1])
            st.out_sorted[lo + r0: lo + r1] = dn[r0:r1]

    def _combine(self, h: np.ndarray) -> None:
        st = self._state
        top_k = st.ids.shape[1]
        out = np.empty_like(st.out_sorted)
        out[st.order] = st.out_sorted
        out = out.reshape(h.shape[0], top_k, -1)
        y = np.zeros_like(h)
        for k in range(top_k):
            y += st.w[:, k, None] * out[:, k]
        h += y

    def close(self) -> None:
        self.resident = self.ring = self.gu_buf = self.dn_buf = None
