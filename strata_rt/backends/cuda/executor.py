"""The CUDA executor: runs the chunk driver's plans on one GPU.

Memory. Expert blobs sit in one page-locked host arena (the ExpertStore); one device arena
(memory_plan.plan_memory) holds the router and norm weights, the resident slots, the ring, the
group buffers and one chunk's activations: the chunk first, then as many resident experts as
the budget holds (or the config's count), after any `image_cache_mib` room (image_cache).

Execution. Each plan op becomes one driver call on the stream the op names. The staging ring
reads each layer's row bounds back on a stream of their own; the walk's kernels read them on
the device, so the driver can capture the whole walk as a CUDA graph (`capture`; a routed
walk's copies switched inside it: routed_walk). The chunk's input passes a gate its host pass
opens (chunk_input): hidden states, or token ids whose embedding rows the GPU decodes. A
second compute lane (schedule.vram.lanes) has its own stream and group buffers. Short chunks read
resident groups in place (schedule.vram.in_place; a whole layer at once: products); a decode step's
RoutedExperts reads experts where they lie (routed_experts); split parts hand off (split_part).
Copies, events and gathers: ring_ops. A layer pass holds a whole prompt's residual and moves
the chunk's rows over it (prompt_pass)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import StrataError
from ...formats.contract import FormatKernels
from ...report.stats import Stats
from ...report.timing import PhaseTimer
from ...runtime.hostmap import host_device_pointer
from ...schedule.plan import (
    Attention,
    ChunkInput,
    Consume,
    DenseCopy,
    Gather,
    GatherBatch,
    GatherRouted,
    HandOff,
    LayerBegin,
    LayerEnd,
    Logits,
    Op,
    Products,
    PromptRows,
    RouteCopies,
    RoutedExperts,
)
from ...schedule.split import whole_part
from ...schedule.vram.image_cache import ImageCache
from ...schedule.vram.in_place import chunk_in_place
from ...schedule.vram.lanes import chunk_lanes, walk_rows_hint
from ...schedule.vram.residency import Residency
from .chunk_input import chunk_token_ids
from .context import CudaContext
from .device_open import open_device
from .device_state import DeviceState
from .experts.products import product_ops
from .experts.routed_experts import RoutedExpertsRunner
from .experts.routed_walk import RoutedWalkCopies
from .layer_kernels import ENGINE_SOURCE, LayerKernels
from .prompt_pass import NO_ROW, PassReplay, PromptPass, flag_error
from .ring_ops import ring_ops
from .split_part import PartLink, PartReplay, capture_plan

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from ...config.settings.engine_config import EngineConfig
    from ...models.qwen3.weights import Qwen3Model
    from ...runtime import Graph, Stream
    from ...schedule.executor import HostContext, Replay
    from ...schedule.plan import InputKind
    from ...schedule.split import Part
    from ...schedule.vram.in_place import InPlaceSetting
    from ...schedule.vram.memory_plan import MemoryPlan
    from ...weights.model import Model
    from ...weights.store import ExpertStore
    from .whole import CudaWhole

__all__ = ["ENGINE_SOURCE", "CudaBackend", "CudaContext", "walk_rows_hint"]


class CudaBackend:
    name = "cuda"
    context_class = CudaContext
    host_is_wall = False
    #: a whole model sets these at open (see schedule.executor: Executor and Backend)
    dense_ring: int | None = None
    kv_capacity = 0
    #: the image cache (set at open; empty unless the config gives it room)
    images = ImageCache()
    #: "tokens" where a whole model's chunks bring token ids (set at open), else "hidden"
    input_kind: InputKind = "hidden"
    #: prompt rows a layer pass can hold (set at open: the KV cache's positions where
    #: prefill_order asks for passes and the memory plan has room, else 0; prompt_pass)
    pass_tokens = 0
    _pass: PromptPass | None = None
    # set at open (device_open.open_device)
    fks: list[FormatKernels]
    in_place: InPlaceSetting
    lanes: int
    residency: Residency
    walk_slots: int
    tokens: int
    memory: MemoryPlan
    kernels: LayerKernels
    _whole: CudaWhole | None

    def __init__(self, model: Model, store: ExpertStore, residency: Residency | None,
                 cfg: EngineConfig, context: HostContext, whole: Qwen3Model | None = None,
                 part: Part | None = None):
        if not isinstance(context, CudaContext):
            raise TypeError(f"the CUDA backend runs on a CudaContext, got {type(context).__name__}")
        #: the layers this executor runs (a split's part; else all, on the first device),
        #: and in a split every part's executor by part index (set by the split's open)
        self.part = part if part is not None else whole_part(model.spec.n_layers)
        self.first = self.part.first
        self.peers: list[CudaBackend] = []
        self._link = PartLink(self) if self.part.n_parts > 1 else None
        self.rt = context.runtime(None if part is None else part.device)
        self.model, self.store, self.cfg, self.whole = model, store, cfg, whole
        self.spec, self.fmt, self.lay = model.spec, model.fmt, model.layout
        self.layer_blob_bytes = tuple(lay.blob_bytes for lay in model.formats.layouts)
        self.timing = bool(cfg.timing)
        self.can_capture = bool(cfg.cuda_graph) and not self.timing
        self.routed_copies = RoutedWalkCopies.supported(self.can_capture)
        assert cfg.f16_gemm is not None, "EngineConfig.resolve() sets f16_gemm"
        #: every grouped fp16 GEMM prepared on this runtime (the format's kernels, the own
        #: dense GEMM) takes the config's policy from it
        self.rt.f16_gemm = cfg.f16_gemm
        self.dev: DeviceState | None = None
        try:
            with self.current():
                self._open(residency, context)
        except BaseException:
            self.close()
            raise

    def current(self) -> AbstractContextManager[Any]:
        """This backend's context made current (the split driver runs each part inside it)."""
        return self.rt.current()

    # ------------------------------------------------------------------ open
    def _open(self, residency: Residency | None, context: CudaContext) -> None:
        o = open_device(self.rt, self.model, self.store, self.cfg, self.part, self.whole,
                        residency, context)  # memory plan, arena, weights (device_open.py)
        self.fks, self.in_place, self.kv_capacity, self.lanes = o.fks, o.in_place, \
            o.kv_capacity, o.lanes
        self.dense_ring, self.residency, self.images = o.dense_ring, o.residency, o.images
        self.walk_slots, self.tokens, self.memory = o.walk_slots, o.tokens, o.memory
        self.dev, self.kernels, self._whole = o.dev, o.kernels, o.whole
        self.input_kind, self.pass_tokens = o.input_kind, o.pass_tokens
        dev = self._device()
        if self.pass_tokens:
            self._pass = PromptPass(self.rt, dev, self.spec.hidden, len(self.part.layers),
                                    self.spec.n_experts, self.tokens, self.pass_tokens,
                                    self.input_kind)
        self._timer = PhaseTimer(self.rt, dev.compute, dev.copy) if self.timing else None
        self._routed = RoutedExpertsRunner(self)
        self.walk_copies = RoutedWalkCopies(self.rt, self.rt.stream("switched copies"))
        self._dispatch: dict[type, Callable[[Any], None]] = {
            **ring_ops(self), Consume: _no_op, RoutedExperts: self._routed.run,
            **product_ops(self),
            ChunkInput: self._op_chunk_input, LayerBegin: self._op_layer_begin,
            LayerEnd: self._op_layer_end, Attention: self._op_attention,
            PromptRows: self._op_prompt_rows,
            DenseCopy: self._op_dense_copy, Logits: self._op_logits, HandOff: self._op_handoff,
            RouteCopies: lambda op: self.walk_copies.route(op, self._device().compute,
                                                           self._bounds_ptr(op.layer)),
        }
        self._counts: np.ndarray | None = None
        self._store_dev: int | None = None
        self._T = 0

    def max_chunk_tokens(self) -> int:
        return self.tokens

    def lanes_for(self, tokens: int) -> int:
        return chunk_lanes(self.lanes, tokens, self.spec, self.timing)

    def in_place_for(self, tokens: int) -> bool:
        return chunk_in_place(self.in_place, self.model.formats.in_place_format, tokens,
                              self.spec)

    # ------------------------------------------------------------------ chunk (Executor)
    def begin_chunk(self, x: np.ndarray, stats: Stats, start: int | None = None) -> None:
        """x: hidden states float32 [T, hidden], or (input_kind "tokens") T token ids,
        range-checked here before anything is enqueued (chunk_input)."""
        ids = (chunk_token_ids(x, self._whole_ops().spec.vocab)
               if self.input_kind == "tokens" else None)
        dev = self._begin(int(x.shape[0]), stats)
        if ids is None:
            dev.input.start(x, self.spec.hidden)
        else:
            dev.input.start_tokens(ids)
        if start is not None and self._whole is not None:
            if self.part.sends:  # uploaded at ChunkInput, after the receiver took the last
                self._whole.hold_position(start)
            else:
                self._whole.set_position(dev.compute, start)

    def begin_pass(self, x: np.ndarray, stats: Stats, start: int) -> None:
        """A layer pass's prompt: like begin_chunk, but x holds all its P rows (P up to
        pass_tokens), which PromptRows ops then take chunk by chunk (prompt_pass)."""
        pp = self._pass
        if pp is None:
            raise StrataError("this backend holds no layer pass: prefill_order is \"chunks\", "
                              "the model is no whole model on one device, or its memory plan "
                              "had no room for the prompt's residual")
        pp.check(int(x.shape[0]), start, self.kv_capacity)
        ids = (chunk_token_ids(x, self._whole_ops().spec.vocab)
               if self.input_kind == "tokens" else x)
        dev = self._begin(min(int(x.shape[0]), self.tokens), stats)
        counts = stats.routing_counts
        self._T = pp.begin(ids, None if counts is None else counts[self.first: self.part.end])
        self._whole_ops().set_position(dev.compute, start)

    def begin_received(self, tokens: int, stats: Stats) -> None:
        self._begin(int(tokens), stats)  # the residual and position come with the HandOff

    def _begin(self, T: int, stats: Stats) -> DeviceState:
        if not 0 < T <= self.tokens:
            raise StrataError(f"chunk of {T} tokens; this backend's buffers hold 1.."
                              f"{self.tokens} (prefill)")
        dev = self._device()
        if self._pass is not None:
            self._pass.leave()  # a pass that failed midway
        if self._timer is not None and stats.chunk_index == 0:
            self._timer.reset()
        self.rt.memset_d8(dev.ptr["nonfinite"], 0xFF, 8, dev.compute)  # no row flagged yet
        self._T = T
        if self._whole is not None:
            self._whole.drop_logits()
        return dev

    def end_chunk(self, stats: Stats, output: bool = True) -> np.ndarray:
        """The chunk's output: rows of the pinned `io`, reused by the next chunk (the engine
        copies them out first); after a layer pass a new array of all the prompt's rows.
        output False: the residual is not copied back (an empty array)."""
        dev = self._device()
        if self._timer is not None:
            self._timer.end_chunk()
        passing = self._passing()
        if passing:
            out = self._passer().read_back(output)
        else:
            out = dev.io[: self._T * self.spec.hidden].reshape(self._T, self.spec.hidden)
            if not output:
                out = out[:0]
            elif self.part.last:
                self.rt.memcpy_dtoh(out, dev.ptr["x"], dev.compute)
            dev.nonfinite_host[0] = NO_ROW  # what the copy below overwrites
            self.rt.memcpy_dtoh(dev.nonfinite_host, dev.ptr["nonfinite"], dev.compute)
            if not self.part.last:  # the residual stays for the receiver; finish_chunk checks
                return out[:0]
        self.finish_chunk()
        if self._timer is not None and (passing or stats.chunk_index == stats.n_chunks - 1):
            for phase, ms in self._timer.totals_ms.items():
                stats.phase_s[phase] += ms / 1e3
            stats.phase_table = self._timer.table(host_s=stats.host_s)
            stats.trace = list(self._timer.trace)
        return out

    def finish_chunk(self) -> None:
        """Waits for the chunk; refuses it when its input or an RMSNorm input was not finite
        (a split's part before the last: called once every part of the chunk is issued)."""
        dev = self._device()
        dev.compute.synchronize()
        dev.add_routing()
        if self._passing():
            self._passer().finish()  # its input, routing and flags; back to ordinary chunks
        else:
            dev.input.finish()
            error = flag_error(int(dev.nonfinite_host[0]))
            if error is not None:
                raise error
        if self._whole is not None:  # the logits the Logits op left in pinned memory
            self._whole.finish_chunk()

    def take_logits(self) -> np.ndarray:
        return self._whole_ops().take_logits()

    def take_argmax(self) -> int | None:
        return self._whole_ops().take_argmax()

    def sample_last(self, params: Any, seen: Any, step: int) -> int:
        return self._whole_ops().sample_last(self._device().compute, params, seen, step)

    def route_layer(self, layer: int) -> None:
        dev = self._device()
        self.kernels.route(dev.compute, layer, self._T, self._bounds_ptr(layer), self._mark)
        self._mark("host grouping")
        dev.routed.record(dev.compute)
        dev.readback.wait(dev.routed)
        self.rt.memcpy_dtoh(dev.bounds_host[layer - self.first], self._bounds_ptr(layer),
                            dev.readback)

    def routed_counts(self, layer: int, stats: Stats) -> np.ndarray:
        dev = self._device()
        dev.readback.synchronize()
        counts = np.diff(dev.bounds_host[layer - self.first])
        if stats.routing_counts is not None:
            stats.routing_counts[layer] += counts
        return counts

    def execute(self, ops: Iterable[Op], stats: Stats, counts: np.ndarray | None) -> None:
        self._counts = counts
        dispatch = self._dispatch
        for op in ops:
            dispatch[type(op)](op)

    def capture(self, ops: Iterable[Op]) -> Graph | PartReplay | PassReplay:
        graph = capture_plan(self, ops, linked=self._link is not None)
        return self._passer().captured(graph) if self._passing() else graph

    def replay(self, replay: Replay) -> None:
        replay.launch(self._device().compute)
        if isinstance(replay, PassReplay):
            self._T = self._passer().replayed(replay)

    def synchronize(self) -> None:
        self._device().compute.synchronize()

    def collect_walk_routing(self, stats: Stats) -> None:
        """Added at the chunk's wait (finish_chunk); a split's part before the last waits now."""
        dev, counts = self._device(), stats.routing_counts
        assert counts is not None
        if self._passing():
            return  # a pass reads each chunk's routing back itself (prompt_pass)
        dev.routing_readback(counts[self.first: self.part.end])
        if not self.part.last:
            dev.compute.synchronize()
            stats.host_syncs += 1
            dev.add_routing()

    # ------------------------------------------------------------------ ops
    def _device(self) -> DeviceState:
        if self.dev is None:
            raise StrataError("the CUDA backend is closed")
        return self.dev

    def _mark(self, phase: str) -> None:
        if self._timer is not None:
            self._timer.mark(phase)

    def _bounds_ptr(self, layer: int) -> int:
        return self._device().ptr["bounds"] + (layer - self.first) * (self.spec.n_experts + 1) * 4

    def _lane(self, op: Gather | GatherBatch | GatherRouted | Products
              ) -> tuple[Stream, int, int]:
        """The op's compute lane: its stream and its group buffers (gate/up, down)."""
        return self._device().lanes[op.stream]

    @property
    def routed_gathers(self) -> bool:
        """Whether the format's kernels gather a decode step's routed experts on the device."""
        return all(type(fk).gather_routed is not FormatKernels.gather_routed for fk in self.fks)

    def store_device_address(self) -> int:
        """The pinned host store's device address (looked up once): kernels read it over PCIe."""
        if self._store_dev is None:
            self._store_dev = host_device_pointer(self.store.arena)
        return self._store_dev

    def _op_layer_begin(self, op: LayerBegin) -> None:
        bounds = self._bounds_ptr(op.layer)
        self.kernels.route(self._device().compute, op.layer, self._T, bounds, self._mark)
        if self._passing():
            self._passer().routed(op.layer - self.first, bounds)

    def _op_prompt_rows(self, op: PromptRows) -> None:
        self._T = self._passer().window(op)

    def _passing(self) -> bool:
        return self._pass is not None and self._pass.active

    def _passer(self) -> PromptPass:
        if self._pass is None:
            raise StrataError("a layer pass's op on a backend that holds no pass")
        return self._pass

    def _op_chunk_input(self, op: ChunkInput) -> None:
        """The upload waits at the gate for begin_chunk's host pass (hidden states or ids)."""
        if op.kind != self.input_kind:
            raise StrataError(f"{op!r}: this executor's chunks bring {self.input_kind!r} input")
        dev = self._device()
        self._mark("input")
        source, first, wait = (self._passer().upload_from() if self._passing()
                               else (dev.input, 0, True))
        source.upload(self.rt, op.kind, self._T, self.spec.hidden, dev.ptr,
                      lambda s, ids, T: self._whole_ops().embed(s, ids, T), first, wait)
        if self.part.sends and self._whole is not None:
            self._whole.upload_position(dev.compute)

    def _op_handoff(self, op: HandOff) -> None:
        if self._link is None:
            raise StrataError(f"{op!r} in the plan of an executor that is no split's part")
        self._mark("input")
        self._link.handoff(op)

    def _whole_ops(self) -> CudaWhole:
        if self._whole is None:
            raise StrataError("an Attention or Logits op needs a whole model; this engine runs "
                              "MoE layers alone")
        return self._whole

    def _op_attention(self, op: Attention) -> None:
        self._whole_ops().run_attention(self._device().compute, op, self._T, self._mark)

    def _op_dense_copy(self, op: DenseCopy) -> None:
        if self._timer is not None:
            self._timer.copy_begin(f"dense L{op.layer} -> dense slot {op.slot}")
        self._whole_ops().copy_dense(self._device().copy, op)
        if self._timer is not None:
            self._timer.copy_end()

    def _op_logits(self, op: Logits) -> None:
        self._mark("logits")
        self._whole_ops().logits_op(self._device().compute, op, self._T)

    def _op_layer_end(self, op: LayerEnd) -> None:
        self._mark("combine")
        self.kernels.combine(self._device().compute, self._T)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Drops every CUDA object held here; the engine's runtime close frees the memory."""
        rt = getattr(self, "rt", None)
        if rt is None:
            return
        with rt.current():
            self._close()

    def _close(self) -> None:
        dev, self.dev = self.dev, None
        whole, self._whole = getattr(self, "_whole", None), None
        self._pass = None
        for held in (whole, dev):
            if held is not None:
                held.close()
        self.fks = []
        self.kernels = self._timer = None  # type: ignore[assignment]
        self._dispatch = {}


def _no_op(op: Op) -> None:
    """Consume is host bookkeeping: the plan's op order already encodes it."""

