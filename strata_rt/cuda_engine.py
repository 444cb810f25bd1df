"""The CUDA backend: executes the planners' schedules on one GPU.

Memory. Every expert blob sits in one page-locked host arena (the ExpertStore); one device
arena holds the router and norm weights, the resident expert slots, the ring, the group
buffers of MMQ_GROUP experts and one chunk's activations. Its size is fixed at open: the
chunk's buffers first (the largest chunk up to 8,192 tokens for `prefill: auto`), then as many
resident experts as the rest of the budget holds (or the count the config fixes).

Execution. Each plan op becomes one driver call. A chunk that routes few of a layer's experts
(planner.takes_walk) takes the staging ring: after a layer's routing runs on the GPU its
per-expert row bounds come back to the host on a stream of their own (so the read-back never
queues behind expert copies), and the staging planner turns the routed set into the layer's
ops. Otherwise the streamed walk's whole schedule is known before the chunk starts, every
kernel reads row bounds from device memory, and the chunk is launched without a host sync; that
launch sequence is captured once per chunk size as a CUDA graph, and replay is kept only if it
measured faster than plain launches.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from . import env, hazards
from .activations import ActivationKernels
from .errors import StrataError
from .formats import KERNELS_ROOT
from .memory_plan import DEFAULT_RESERVE_MIB, plan_memory
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
from .runtime.memory import MIB
from .timing import PhaseTimer

ENGINE_SOURCE = KERNELS_ROOT / "common" / "engine.cu"
#: launch shapes of the engine kernels (must match engine.cu where it assumes them)
ROUTER_TILE = 64
TOPK_THREADS = 128
SCATTER_THREADS = 1024
ROW_THREADS = 256
SWIGLU_THREADS = 128
#: the SwiGLU kernels stride over rows, so a capped grid covers any row count
SWIGLU_MAX_BLOCKS = 2048


# ----------------------------------------------------------------------------- host memory
#: runtimes opened by host_alloc, keyed by the address of the store memory they pinned, until
#: the backend built on that store takes them over
_OPENED: dict[int, tuple[Any, Any]] = {}


def _pin_store(nbytes: int) -> np.ndarray:
    """The ExpertStore's memory: one page-locked arena on a freshly opened runtime."""
    from .runtime import Runtime

    rt = Runtime.open()
    try:
        arena = rt.pinned({"store": nbytes})
    except BaseException:
        rt.close()
        raise
    view = arena.view("store")
    _OPENED[int(view.ctypes.data)] = (rt, arena)
    return view


# ----------------------------------------------------------------------------- the backend
class CudaBackend:
    name = "cuda"
    host_alloc = staticmethod(_pin_store)

    def __init__(self, model, store, residency: Residency | None, cfg):
        self.rt = None
        self.closed = False
        opened = _OPENED.pop(int(store.arena.ctypes.data), None)
        if opened is None:
            raise StrataError("CudaBackend needs an ExpertStore built with "
                              "CudaBackend.host_alloc (page-locked memory on its runtime)")
        self.rt, self._store_arena = opened
        try:
            self._open(model, store, residency, cfg)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ open
    def _open(self, model, store, residency: Residency | None, cfg) -> None:
        rt = self.rt
        self.model, self.store, self.cfg = model, store, cfg
        self.spec, self.fmt, self.lay = model.spec, model.fmt, model.layout
        spec, lay = self.spec, self.lay
        self.check_plan = bool(cfg.check_plan)
        self.timing = bool(cfg.timing)
        self.use_graphs = env.flag("STRATA_CUDA_GRAPH", default=True) and not self.timing

        self.compute = rt.stream("compute")
        self.copy = rt.stream("copy")
        self.readback = rt.stream("readback")
        self._streams = {"compute": self.compute, "copy": self.copy}

        mod = rt.module(ENGINE_SOURCE)
        self._k_norm = mod.kernel("rmsnorm_rows", "PPPif")
        self._k_router = mod.kernel("router_logits", "PPPiii")
        self._k_topk = mod.kernel("topk_softmax", "PiiiPP")
        self._k_bounds = mod.kernel("expert_bounds", "PiiP")
        self._k_scatter = mod.kernel("expert_scatter", "PiiPPP")
        self._k_swiglu = mod.kernel(
            "swiglu_q8_1" if self.fmt.activation == "q8_1" else "swiglu_f16", "PPiiiP")
        self._k_combine = mod.kernel("combine_residual", "PPPiiP")
        self._acts = ActivationKernels(rt)
        self.fk = self.fmt.kernels(rt, lay)

        # memory: the budget, then the residency, then one arena
        reserve = cfg.vram_reserve_mib if cfg.vram_reserve_mib is not None else DEFAULT_RESERVE_MIB
        free = rt.free_bytes()
        available = free - int(reserve * MIB)
        slot = lay.slot_bytes
        fixed_res = residency.n_slots if residency is not None else None
        n_streamed_max = spec.total_experts - (fixed_res or 0)
        self.walk_slots = walk_ring_slots(cfg.ring_bytes, slot, max(1, n_streamed_max))
        ring_slots = max(self.walk_slots, STAGING_RING_SLOTS)
        mp = plan_memory(spec, lay, self.fmt.activation, available, ring_slots, cfg.prefill,
                         fixed_res)
        if residency is None:
            residency = Residency.from_budget(model, mp.n_resident, cfg.load_profile())
            # the ring was sized for everything streaming; plan with what actually streams
            self.walk_slots = walk_ring_slots(cfg.ring_bytes, slot,
                                              max(1, spec.total_experts - residency.n_slots))
        self.residency = residency
        self.tokens = mp.tokens
        self.memory = mp
        self.arena = rt.device_arena(mp.regions, budget=max(available, 0))
        a = self.arena
        self.ptr = {name: a.ptr(name) for name in mp.regions}

        pinned = {"io": self.tokens * spec.hidden * 4,
                  "bounds": spec.n_layers * (spec.n_experts + 1) * 4}
        self.host = rt.pinned(pinned)
        self._io = self.host.view("io", np.float32)
        self._bounds_host = self.host.view("bounds", np.int32).reshape(
            spec.n_layers, spec.n_experts + 1)

        # poison everything first: a read of bytes nobody wrote shows up as NaN, not as luck
        rt.memset_d8(a.base_ptr, 0xFF, a.total, self.copy)
        # weights that stay on the device, and the resident experts (once, at open)
        rt.memcpy_htod(self.ptr["router"], model.router, self.copy)
        rt.memcpy_htod(self.ptr["norm"], model.norm, self.copy)
        for i, (layer, e) in enumerate(residency.pairs):
            off = store.offset(layer, e)
            rt.memcpy_htod(self.ptr["resident"] + i * slot,
                           store.arena[off: off + lay.blob_bytes], self.copy)
        self.copy.synchronize()

        self._events: dict[tuple[str, int], Any] = {}
        self._routed = rt.event("routed")
        self._fork = rt.event("walk fork")
        self._join = rt.event("walk join")
        self._timer = PhaseTimer(rt, self.compute) if self.timing else None
        # keyed by (tokens, gather_one): an in-process A/B flips the gather mode between prompts
        self._walk_plans: dict[tuple[int, bool], tuple[ChunkPlan, dict[type, int]]] = {}
        self._graphs: dict[tuple[int, bool], Any] = {}
        #: per walk chunk size: {"plain": s, "graph": s, "choice": "plain" | "graph"}
        self.graph_trials: dict[tuple[int, bool], dict[str, Any]] = {}
        #: host seconds spent enqueuing each layer of the last chunk
        self.layer_host_s: list[float] = []
        self._dispatch = {
            Copy: self._op_copy, Record: self._op_record, Wait: self._op_wait,
            Gather: self._op_gather, GatherBatch: self._op_gather_batch,
            Products: self._op_products, Consume: _no_op, LayerBegin: self._op_layer_begin,
            LayerEnd: self._op_layer_end,
        }
        self._counts: np.ndarray | None = None
        self._T = 0

    def max_chunk_tokens(self) -> int:
        return self.tokens

    @property
    def gather_one(self) -> bool:
        return gathers_one_by_one(self.fmt, self.cfg.gather_one)

    # ------------------------------------------------------------------ chunk
    def run_chunk(self, h: np.ndarray, stats) -> np.ndarray:
        T = int(h.shape[0])
        if not 0 < T <= self.tokens:
            raise StrataError(f"chunk of {T} tokens; this backend's buffers hold 1.."
                              f"{self.tokens} (prefill)")
        t0 = time.perf_counter()
        if self._timer is not None and stats.chunk_index == 0:
            self._timer.reset()
        spec = self.spec
        io = self._io[: T * spec.hidden].reshape(T, spec.hidden)
        io[:] = h
        self.rt.memcpy_htod(self.ptr["x"], io, self.compute)
        self._T = T
        self.layer_host_s = []
        if not takes_walk(T, spec, self.cfg.walk_min_tokens):
            self._run_staging(T, stats)
        else:
            self._run_walk(T, stats)
        if self._timer is not None:
            self._timer.end_chunk()
        self.rt.memcpy_dtoh(io, self.ptr["x"], self.compute)
        self.compute.synchronize()
        stats.host_syncs += 1
        if self._timer is not None and stats.chunk_index == stats.n_chunks - 1:
            for phase, ms in self._timer.totals_ms.items():
                stats.phase_s[phase] += ms / 1e3
            print(self._timer.table(host_s=stats.host_s), file=sys.stderr)
        self.last_chunk_s = time.perf_counter() - t0
        return io  # pinned and reused: the engine copies it out before the next chunk

    def _run_staging(self, T: int, stats) -> None:
        spec = self.spec
        planner = StagingPlanner(spec, self.residency, self.gather_one, tokens=T)
        checker = (hazards.Checker(STAGING_RING_SLOTS, self.residency)
                   if self.check_plan else None)
        for layer in range(spec.n_layers):
            t0 = time.perf_counter()
            self._route(layer, T)
            self._mark("host grouping")
            # the bounds come back on their own stream: never behind the copies of blobs
            self._routed.record(self.compute)
            self.readback.wait(self._routed)
            bounds = self._bounds_host[layer]
            self.rt.memcpy_dtoh(bounds, self._bounds_ptr(layer), self.readback)
            host = time.perf_counter() - t0
            self.readback.synchronize()
            stats.host_syncs += 1
            t0 = time.perf_counter()
            counts = np.diff(bounds)
            if stats.routing_counts is not None:
                stats.routing_counts[layer] += counts
            lp = planner.plan_layer(layer, np.flatnonzero(counts).tolist())
            if checker is not None:
                checker.feed(lp.ops)
            self._counts = counts
            self._execute(op for op in lp.ops if not isinstance(op, LayerBegin))
            _add_counts(stats, op_counts(lp.ops), self.lay.blob_bytes)
            host += time.perf_counter() - t0
            self.layer_host_s.append(host)
            stats.host_s += host
            stats.layer_done(layer)

    def _walk_plan(self, T: int) -> tuple[ChunkPlan, dict[type, int]]:
        key = (T, self.gather_one)
        if key not in self._walk_plans:
            plan = plan_walk(self.spec, self.residency, self.walk_slots, self.gather_one,
                             tokens=T)
            if self.check_plan:
                hazards.check(plan, self.residency)
            self._walk_plans[key] = (plan, op_counts(op for _, op in plan.ops()))
        return self._walk_plans[key]

    def _run_walk(self, T: int, stats) -> None:
        """Plain launches the first time a chunk size is seen (timed), a captured graph the
        second time (timed), then whichever was faster."""
        plan, counts = self._walk_plan(T)
        self._counts = None
        trial = self.graph_trials.setdefault((T, self.gather_one), {})
        graph = None
        if self.use_graphs and "plain" in trial and trial.get("choice") != "plain":
            graph = self._graph_for(T, plan, trial)
        t0 = time.perf_counter()
        if graph is None:
            for lp in plan.layers:
                tl = time.perf_counter()
                self._execute(lp.ops)
                self.layer_host_s.append(time.perf_counter() - tl)
                stats.layer_done(lp.layer)
            stats.host_s += time.perf_counter() - t0
            if self.use_graphs and "plain" not in trial:
                self.compute.synchronize()
                trial["plain"] = time.perf_counter() - t0
        else:
            graph.launch(self.compute)
            stats.host_s += time.perf_counter() - t0
            for lp in plan.layers:
                stats.layer_done(lp.layer)
            if "graph" not in trial:
                self.compute.synchronize()
                trial["graph"] = time.perf_counter() - t0
                trial["choice"] = "graph" if trial["graph"] < trial["plain"] else "plain"
        _add_counts(stats, counts, self.lay.blob_bytes)  # the walk reads nothing back
        if stats.routing_counts is not None:
            self.rt.memcpy_dtoh(self._bounds_host, self.ptr["bounds"], self.compute)
            self.compute.synchronize()
            stats.host_syncs += 1
            stats.routing_counts += np.diff(self._bounds_host, axis=1)

    def _graph_for(self, T: int, plan: ChunkPlan, trial: dict[str, Any]):
        """The captured walk of T tokens (captured on first use); None, after one printed
        line, when the driver refuses the capture."""
        key = (T, self.gather_one)
        if key in self._graphs:
            return self._graphs[key]
        try:
            with self.rt.capture(self.compute) as graph:
                self._fork.record(self.compute)  # the copy stream joins the capture
                self.copy.wait(self._fork)
                self._execute(op for lp in plan.layers for op in lp.ops)
                self._join.record(self.copy)
                self.compute.wait(self._join)
        except Exception as e:  # a driver refusal must not lose the prompt
            print(f"strata: CUDA graph capture of the {T}-token walk failed ({e}); launching "
                  "it kernel by kernel", file=sys.stderr)
            trial["choice"] = "plain"
            trial["error"] = str(e)
            return None
        self._graphs[key] = graph
        return graph

    # ------------------------------------------------------------------ ops
    def _execute(self, ops) -> None:
        dispatch = self._dispatch
        for op in ops:
            dispatch[type(op)](op)

    def _mark(self, phase: str) -> None:
        if self._timer is not None:
            self._timer.mark(phase)

    def _event(self, key: tuple[str, int]):
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self.rt.event(f"{key[0]}[{key[1]}]")
        return ev

    def _bounds_ptr(self, layer: int) -> int:
        return self.ptr["bounds"] + layer * (self.spec.n_experts + 1) * 4

    def _src_ptr(self, g: Gather) -> int:
        kind, idx = g.src
        base = self.ptr["resident"] if kind == RESIDENT else self.ptr["ring"]
        return base + idx * self.lay.slot_bytes

    def _op_copy(self, op: Copy) -> None:
        off = self.store.offset(op.layer, op.expert)
        self.rt.memcpy_htod(self.ptr["ring"] + op.slot * self.lay.slot_bytes,
                            self.store.arena[off: off + self.lay.blob_bytes], self.copy)

    def _op_record(self, op: Record) -> None:
        self._event(op.event).record(self._streams[op.stream])

    def _op_wait(self, op: Wait) -> None:
        if op.stream == "compute":
            self._mark("wait copy")
        self._streams[op.stream].wait(self._event(op.event))

    def _op_gather(self, op: Gather) -> None:
        self._mark("gather")
        self.fk.gather(self.compute, self._src_ptr(op), op.pos, self.ptr["gate_up_buf"],
                       self.ptr["down_buf"])

    def _op_gather_batch(self, op: GatherBatch) -> None:
        self._mark("gather")
        self.fk.gather_batch(self.compute, [self._src_ptr(g) for g in op.gathers],
                             op.first_pos, self.ptr["gate_up_buf"], self.ptr["down_buf"])

    def _op_layer_begin(self, op: LayerBegin) -> None:
        self._route(op.layer, self._T)

    def _route(self, layer: int, T: int) -> None:
        """RMSNorm, router logits, top-k, counting sort and the hidden activations of one
        layer, all on the compute stream; the row bounds stay in device memory."""
        spec, p, s = self.spec, self.ptr, self.compute
        H, E, K = spec.hidden, spec.n_experts, spec.top_k
        self._mark("route")
        self._k_norm.launch(grid=(T, 1, 1), block=(ROW_THREADS, 1, 1), stream=s,
                            args=(p["x"], p["norm"] + layer * H * 4, p["xn"], H,
                                  float(spec.rms_eps)))
        self._k_router.launch(grid=(-(-T // ROUTER_TILE), -(-E // ROUTER_TILE), 1),
                              block=(256, 1, 1), stream=s,
                              args=(p["xn"], p["router"] + layer * E * H * 4, p["logits"], T,
                                    H, E))
        self._k_topk.launch(grid=(-(-T // TOPK_THREADS), 1, 1), block=(TOPK_THREADS, 1, 1),
                            stream=s, args=(p["logits"], T, E, K, p["topk_ids"], p["topk_w"]))
        bounds = self._bounds_ptr(layer)
        self._k_bounds.launch(grid=(1, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=s,
                              args=(p["topk_ids"], T * K, E, bounds), shared=E * 4)
        self._k_scatter.launch(grid=(E, 1, 1), block=(SCATTER_THREADS, 1, 1), stream=s,
                               args=(p["topk_ids"], T * K, K, bounds, p["sorted_token"],
                                     p["row_of"]))
        self._acts.launch(self.fmt.activation, s, p["xn"], H, p["sorted_token"],
                          p["act_hidden"], T * K, H)

    def _op_products(self, op: Products) -> None:
        spec, p, s = self.spec, self.ptr, self.compute
        H, F = spec.hidden, spec.ffn
        ids = op.expert_ids
        lo, hi = ids[0], ids[-1] + 1
        if self._counts is not None:  # staging: exact counts are on the host
            rows_hint = int(self._counts[list(ids)].max())
            group_rows = int(self._counts[lo:hi].sum())
            if group_rows == 0:
                return
        else:  # walk: counts stay on the device; kernels loop over row tiles past the hint
            rows_hint = walk_rows_hint(self._T, spec)
            group_rows = min(self._T * spec.top_k, len(ids) * self._T)
        bounds = self._bounds_ptr(op.layer)
        self._mark("gemm gate/up")
        self.fk.mmq(s, p["gate_up_buf"], ids, p["act_hidden"], bounds, p["gate_up_out"],
                    2 * F, H, rows_hint)
        self._mark("swiglu+quantize")
        self._k_swiglu.launch(grid=(min(group_rows, SWIGLU_MAX_BLOCKS), 1, 1),
                              block=(SWIGLU_THREADS, 1, 1), stream=s,
                              args=(p["gate_up_out"], bounds, lo, hi, F, p["act_ffn"]))
        self._mark("gemm down")
        self.fk.mmq(s, p["down_buf"], ids, p["act_ffn"], bounds, p["down_out"], H, F,
                    rows_hint)

    def _op_layer_end(self, op: LayerEnd) -> None:
        spec, p = self.spec, self.ptr
        self._mark("combine")
        self._k_combine.launch(grid=(self._T, 1, 1), block=(ROW_THREADS, 1, 1),
                               stream=self.compute,
                               args=(p["down_out"], p["row_of"], p["topk_w"], spec.top_k,
                                     spec.hidden, p["x"]))

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Frees everything. References to streams, events, kernels and arenas go first, so
        they die while the context still lives (Runtime.close collects them before it pops)."""
        if self.closed:
            return
        self.closed = True
        for graph in getattr(self, "_graphs", {}).values():
            graph.free()
        rt, self.rt = self.rt, None
        for name in _DEVICE_ATTRS:
            self.__dict__.pop(name, None)
        if rt is not None:
            rt.close()


#: attributes that hold CUDA objects (dropped before the runtime closes)
_DEVICE_ATTRS = (
    "compute", "copy", "readback", "_streams", "_k_norm", "_k_router", "_k_topk", "_k_bounds",
    "_k_scatter", "_k_swiglu", "_k_combine", "_acts", "fk", "arena", "host", "_io",
    "_bounds_host", "_events", "_routed", "_fork", "_join", "_timer", "_graphs",
    "_store_arena", "_dispatch", "store")


def _no_op(op: Op) -> None:
    """Consume is host bookkeeping: the plan's op order already encodes it."""


def walk_rows_hint(tokens: int, spec) -> int:
    """Rows per expert the walk sizes its MMQ grids for, where the counts never reach the host:
    twice the mean rows per expert (a token picks an expert at most once, so never more than
    tokens). A busier expert is still covered, by fewer blocks looping over its tiles; sizing
    for the worst case (all tokens) launched 8x more blocks, nearly all of them exiting."""
    return max(1, min(tokens, -(-2 * tokens * spec.top_k // spec.n_experts)))


def op_counts(ops) -> dict[type, int]:
    """How many ops of each kind a plan (or a layer of it) holds."""
    counts: dict[type, int] = {}
    for op in ops:
        counts[type(op)] = counts.get(type(op), 0) + 1
    return counts


def _add_counts(stats, counts: dict[type, int], blob_bytes: int) -> None:
    copies = counts.get(Copy, 0)
    stats.experts_streamed += copies
    stats.bytes_streamed += copies * blob_bytes
    stats.gathers_launched += counts.get(Gather, 0) + counts.get(GatherBatch, 0)
    stats.mmq_launches += 2 * counts.get(Products, 0)
