"""The chunk driver: how one chunk of tokens goes through the MoE layers, for every backend.

A backend is an executor: it routes a layer, runs plan ops, and (if it can) captures a
sequence of ops for replay. Everything else about a chunk is decided here, once:

- the order of a whole model's prompt of several chunks: chunk by chunk (the engine's loop), or
  the layer pass (schedule.planners.layer_pass: each layer over every chunk, its streamed
  experts crossing PCIe once), as `prefill_order` asks and `layer_pass` decides;
- the streaming path: the staging ring (routed experts only, planned layer by layer after the
  routed set comes back to the host), the streamed walk (every non-resident expert, planned
  before the chunk starts) - `planner.takes_walk` - or the routed plan (the gathers read only
  the routed non-resident experts from host memory, planned before the chunk starts), where
  the routing measured on earlier chunks makes it cheaper than the walk (`prefill_stream`);
- the planners, the walk-plan cache, STRATA_CHECK_PLAN (the hazard checker on every plan);
- table products (`layer_products`): every plan, as soon as it is made, has the in-place
  products of each whole-resident layer merged into one LayerProducts where the layer's format
  offers it and the config's `table_products` is not off;
- CUDA-graph trials on the walk: plain launches the first time a chunk size is seen (timed),
  a captured replay the second time (timed), then whichever was faster;
- the counters (experts and bytes streamed, gathers, matmul launches, host syncs, host time)
  and progress (`stats.layer_done`).

A new streaming policy touches this module and its planner; the executors and the hazard
checker keep reading the same Plan.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import StrataError
from ..report.stats import Stats
from . import hazards
from .executor import Executor, Replay
from .plan import ChunkPlan, LayerBegin, LayerPlan, LogitRows, Logits, Op
from .plan_counts import add_counts, copy_bytes, op_counts, with_routing
from .plan_keys import (
    DECODE_KEYS,
    GEMV_DECODE_KEY,
    ROUTED,
    ROUTED_WALK,
    WalkKey,
    decode_key,
    decodes_planned,
    resolve_decode,
)
from .planners.dense_schedule import DenseSchedule
from .planners.layer_pass import pass_key, pass_of, plan_layer_pass, takes_layer_pass, windows
from .planners.layer_products import merge_layer, merge_layer_products, table_layers
from .planners.planner import (
    STAGING_RING_SLOTS,
    StagingPlanner,
    gathers_one_by_one,
    plan_decode,
    plan_routed,
    plan_walk,
    takes_walk,
)
from .planners.ring_builder import group_ring_entries
from .prefill_stream import StreamChooser
from .vram.residency import Residency

if TYPE_CHECKING:
    from ..config.settings.engine_config import EngineConfig
    from ..weights.layer_formats import LayerFormats
    from ..weights.model import MoESpec
    from .split import Part

log = logging.getLogger(__name__)


class ChunkDriver:
    """Runs chunks on one executor. `gather_one` and `walk_min_tokens` are read from the
    engine config on every chunk, so an in-process A/B takes effect on the next prompt.
    part: one device's layers of a layer split (None: every layer). A part's plans carry
    hand-off ops that only the split checker orders, so the split driver
    (strata_rt.schedule.split.driver) checks them across the parts instead of this driver."""

    def __init__(self, spec: MoESpec, formats: LayerFormats, cfg: EngineConfig,
                 executor: Executor, part: Part | None = None):
        self.spec, self.formats, self.cfg = spec, formats, cfg
        self.executor = executor
        self.part = part
        self.span = range(spec.n_layers) if part is None else part.layers
        split = part is not None and part.n_parts > 1
        self.check_plan = bool(cfg.check_plan) and not split
        #: the plan of the last chunk (staging: the layers planned so far)
        self.last_plan: ChunkPlan | None = None
        #: host seconds spent issuing each layer of the last chunk
        self.layer_host_s: list[float] = []
        #: what reads the chunk's routing once the chunk's end has waited for it
        self._after_chunk: list[Callable[[], None]] = []
        #: per walk key (chunk size, gather_one, attention start or None):
        #: {"plain": s, "graph": s, "choice": ...}
        self.graph_trials: dict[WalkKey, dict[str, Any]] = {}
        self._walk_plans: dict[WalkKey, tuple[ChunkPlan, dict[type, int], int]] = {}
        self._replays: dict[WalkKey, Replay] = {}
        #: the routing measured per chunk length, and the walk-or-routed rule on it
        self.streams = StreamChooser()
        #: a routed walk's capture failed: plainly launched it copies every expert, so auto
        #: no longer takes it (its switches exist only in a graph)
        self._switches_failed = False
        #: per decode setting: the setting it resolves to and the plan key it runs
        self._decodes: dict[str | None, tuple[str | None, WalkKey]] = {}
        _ = self.decode_key  # decode "gemv" on a model that cannot run it fails at open
        #: the layers whose whole-resident products merge into a LayerProducts (fixed at open)
        self.table_layers = table_layers(cfg.table_products, formats.offers_mmq_table,
                                         self.span)

    @property
    def gather_one(self) -> bool:
        return gathers_one_by_one(self.formats, self.cfg.gather_one)

    @property
    def residency(self) -> Residency:
        return self.executor.residency

    # ------------------------------------------------------------------ a chunk
    def run_chunk(self, x: np.ndarray, stats: Stats, start: int | None = None,
                  logits: LogitRows | None = None, pass_chunk: int | None = None,
                  output: bool = True) -> np.ndarray:
        """Runs one chunk of input x (as the executor's input_kind names it). MoE layers
        alone when start is None; a whole model's chunk at absolute position `start`
        otherwise (each layer opens with its Attention, and `logits` asks for the output head
        over the last row or all rows afterwards). pass_chunk: x is a whole model's prompt,
        run as a layer pass in chunks of that many rows (where `layer_pass` said it may);
        output False: the caller reads no hidden states (Executor.end_chunk)."""
        if pass_chunk is None:
            self.executor.begin_chunk(x, stats, start)
        elif start is None:
            raise ValueError("a layer pass needs a whole model's prompt (start is None)")
        else:
            self.executor.begin_pass(x, stats, start)
        return self._run(int(x.shape[0]), stats, start, logits, pass_chunk, output)

    def layer_pass(self, tokens: int, chunk: int, start: int | None,
                   logits: LogitRows | None) -> bool:
        """Whether a whole model's prompt of `tokens` rows in chunks of `chunk` runs as a layer
        pass (layer_pass.takes_layer_pass)."""
        return takes_layer_pass(self.cfg.prefill_order, self.cfg.prefill_stream,
                                self.executor, self.residency, tokens, chunk,
                                start, logits, takes_walk(chunk, self.spec,
                                                          self.cfg.walk_min_tokens),
                                self.part is not None)

    def run_received(self, tokens: int, stats: Stats, start: int | None = None,
                     logits: LogitRows | None = None, output: bool = True) -> np.ndarray:
        """Runs one chunk of a split part that receives its residual (and position) through
        the HandOff its plan opens with; `start`: the plan's (None for MoE layers alone)."""
        begin = getattr(self.executor, "begin_received", None)
        if begin is None:
            raise TypeError(f"the {self.executor.name} executor cannot receive a hand-off")
        begin(tokens, stats)
        return self._run(tokens, stats, start, logits, output=output)

    def _run(self, T: int, stats: Stats, start: int | None, logits: LogitRows | None,
             pass_chunk: int | None = None, output: bool = True) -> np.ndarray:
        self.layer_host_s, self._after_chunk = [], []
        # a planned chunk enqueues its Logits before the routing comes back (one wait for both)
        tail: list[Op] = [] if logits is None or start is None else [Logits(logits)]
        mode = "pass" if pass_chunk is not None else "decode" if (
            T == 1 and start is not None and self.decodes_routed) else self.stream_mode(T)
        if mode == "pass":
            assert pass_chunk is not None and start is not None
            self._run_planned(T, stats, pass_key(T, pass_chunk, self.gather_one, start), tail)
        elif mode == "decode":
            self._run_decode(stats, tail)
        elif mode in ("routed", "routed_walk"):
            self._run_routed(T, stats, (T, ROUTED if mode == "routed" else ROUTED_WALK, start),
                             tail)
        elif takes_walk(T, self.spec, self.cfg.walk_min_tokens):
            self._run_walk(T, stats, start, tail)
        else:
            self._run_staging(T, stats, start)
            self.executor.execute(tail, stats, None)
        if logits is not None and start is None:
            raise ValueError("logits need a whole model's chunk (start is None)")
        out = self.executor.end_chunk(stats, output)
        stats.host_syncs += 1  # the chunk's output comes back, and its routing with it
        for read in self._after_chunk:
            read()
        return out

    @property
    def decodes_routed(self) -> bool:
        """Whether a one-token step runs a decode plan, not the staging ring (read per step)."""
        return decodes_planned(self.decode_mode, self.executor.routed_gathers)

    @property
    def decode_mode(self) -> str | None:
        """The decode setting this model runs (plan_keys.resolve_decode)."""
        return self._decode()[0]

    @property
    def decode_key(self) -> WalkKey:
        """The decode plan a step runs (plan_keys.decode_key)."""
        return self._decode()[1]

    @property
    def decode_path(self) -> str | None:
        """What a one-token step runs: "gemv", "routed" (decode plans) or "staging"."""
        return self.decode_mode if self.decodes_routed else "staging"

    def _decode(self) -> tuple[str | None, WalkKey]:
        """decode_mode and decode_key of the config's decode setting, worked out once per
        setting (a changed field takes the next step); a refusal is not kept, so it is raised
        again on every step."""
        mode = self.cfg.decode
        if mode not in self._decodes:
            resolved = resolve_decode(mode, self.formats, self.span)
            self._decodes[mode] = (resolved, decode_key(resolved, self.formats, self.span))
        return self._decodes[mode]

    def stream_mode(self, T: int) -> str:
        """"routed_walk" or "routed" where a T-token chunk streams only its routed experts
        (forced by prefill_stream, or chosen by `streams` from the routing measured at that
        length: the routed walk where this executor can switch copies), else "walk" (which
        stands for the walk or the staging ring, as takes_walk decides)."""
        if T == 1 or not self.executor.routed_gathers:
            return "walk"
        forced, ex = self.cfg.prefill_stream or "auto", self.executor
        switches = ex.routed_copies and ex.walk_slots >= self._group_ring_entries \
            and not self._switches_failed
        if forced == "routed_walk" and not switches:
            why = (f"the {ex.name} backend cannot switch copies on the device (the CUDA "
                   "backend needs CUDA graphs on and a 12.4+ driver)" if not ex.routed_copies
                   else "its capture failed earlier (see the warning)"
                   if self._switches_failed else
                   f"a group streams {self._group_ring_entries} experts, gathered in one "
                   f"launch, and the walk ring holds {ex.walk_slots} slots: give it more "
                   "room (ring_mib)")
            raise StrataError(f"prefill_stream routed_walk: {why}")
        if forced == "routed_walk":
            return forced
        if forced == "auto" and not takes_walk(T, self.spec, self.cfg.walk_min_tokens):
            return "walk"  # the staging ring's chunks: few experts routed, known per layer
        return self.streams.choose(T, self.walk_bytes(), forced, switches)

    @functools.cached_property
    def _group_ring_entries(self) -> int:
        """The ring slots a routed walk needs (the residency is fixed for the engine's life)."""
        return group_ring_entries(self.residency, self.span, self.spec.n_experts)

    def walk_bytes(self) -> int:
        """Bytes a walk copies: every non-resident expert of every layer this driver runs."""
        per_layer = (~self.residency.mask()).sum(axis=1)
        span = list(self.span)
        return int(np.dot(per_layer[span], np.asarray(self.executor.layer_blob_bytes)[span]))

    def _run_decode(self, stats: Stats, tail: list[Op]) -> None:
        """A one-token step from the decode plan (planned once; replayed as a CUDA graph when
        the trial finds it faster). Its routed set never reaches the host during the step; it
        is read back afterwards (one small copy) for the counters: an expert streamed is a
        routed expert that is not resident, read over PCIe by its gather."""
        self._run_routed(1, stats, self.decode_key, tail)

    def _run_routed(self, T: int, stats: Stats, key: WalkKey, tail: list[Op]) -> None:
        """The decode plan or a chunk's routed plan; the routing comes back with the chunk's
        output (one small copy) for the counters and the stream rule's record."""

        def count(experts: int, nbytes: int) -> None:
            stats.experts_streamed += experts
            stats.bytes_streamed += nbytes
            if key not in DECODE_KEYS:
                self.streams.observe(T, nbytes)

        self._after_chunk.append(with_routing(
            stats, self.executor, self.spec, lambda: self._run_planned(T, stats, key, tail), count))

    def _run_staging(self, T: int, stats: Stats, start: int | None) -> None:
        ex = self.executor
        planner = StagingPlanner(self.spec, self.residency, self.gather_one, tokens=T,
                                 attention=self._schedule(start), lanes=ex.lanes_for(T),
                                 in_place=ex.in_place_for(T), part=self.part)
        checker = (hazards.Checker(STAGING_RING_SLOTS, self.residency)
                   if self.check_plan else None)
        planned: list[LayerPlan] = []
        for layer in self.span:
            t0 = time.perf_counter()
            pre = planner.pre_routing_ops(layer)  # the input and attention feed the routing
            if pre:
                ex.execute(pre, stats, None)
            ex.route_layer(layer)
            host = time.perf_counter() - t0
            counts = ex.routed_counts(layer, stats)  # the wait is not host work
            stats.host_syncs += 1
            t0 = time.perf_counter()
            lp = planner.plan_layer(layer, np.flatnonzero(counts).tolist())
            if layer in self.table_layers:
                lp = merge_layer(lp, self.spec.n_experts)
            planned.append(lp)
            if checker is not None:
                checker.feed(lp.ops)
            ex.execute((op for op in lp.ops[len(pre):] if not isinstance(op, LayerBegin)),
                       stats, counts)
            add_counts(stats, op_counts(lp.ops), copy_bytes(lp.ops, ex.layer_blob_bytes))
            host += time.perf_counter() - t0
            self.layer_host_s.append(host)
            stats.host_s += host
            stats.layer_done(layer)
        self.last_plan = replace(planner.chunk_plan(), layers=planned)

    def _schedule(self, start: int | None) -> DenseSchedule | None:
        """A whole model's attention ops for a chunk at `start` (None: MoE layers alone)."""
        if start is None:
            return None
        return DenseSchedule(self.span.stop, start, self.executor.dense_ring, self.span[0],
                             self.executor.input_kind)

    def walk_plan(self, T: int, start: int | None = None
                  ) -> tuple[ChunkPlan, dict[type, int], int]:
        """The walk of a T-token chunk, its op counts and the bytes its copies move (planned
        and checked once per chunk size, gather mode and attention start)."""
        return self._planned((T, self.gather_one, start))

    def decode_plan(self) -> tuple[ChunkPlan, dict[type, int], int]:
        """The decode plan of a whole model's one-token step, its op counts and copy bytes."""
        return self._planned(self.decode_key)

    def _planned(self, key: WalkKey) -> tuple[ChunkPlan, dict[type, int], int]:
        if key not in self._walk_plans:
            T, gather_one, start = key
            layer_pass = pass_of(key)
            if layer_pass is not None:
                assert start is not None
                chunk, one = layer_pass
                ex, attention = self.executor, self._schedule(start)
                assert attention is not None
                plan = plan_layer_pass(self.spec, self.residency, ex.walk_slots, one, start,
                                       windows(T, chunk), attention, ex.images,
                                       ex.lanes_for(chunk), ex.in_place_for(chunk))
            elif key in DECODE_KEYS:
                attention = DenseSchedule(self.span.stop, None, self.executor.dense_ring,
                                          self.span[0], self.executor.input_kind)
                plan = plan_decode(self.spec, self.residency, attention,
                                   self.executor.in_place_for(1), self.part,
                                   gemv=key == GEMV_DECODE_KEY)
            elif gather_one == ROUTED:
                plan = plan_routed(self.spec, self.residency, self._schedule(start),
                                   self.executor.in_place_for(T), T, self.part)
            else:
                assert isinstance(gather_one, bool) or gather_one == ROUTED_WALK
                plan = plan_walk(self.spec, self.residency, self.executor.walk_slots,
                                 gather_one is True, tokens=T, attention=self._schedule(start),
                                 images=self.executor.images,
                                 lanes=self.executor.lanes_for(T),
                                 in_place=self.executor.in_place_for(T), part=self.part,
                                 routed_copies=gather_one == ROUTED_WALK,
                                 copy_chains=self.cfg.copy_streams)
            plan = merge_layer_products(plan, self.spec.n_experts,
                                        self.table_layers.__contains__)
            if self.check_plan:
                hazards.check(plan, self.residency, images=self.executor.images)
            ops = [op for _, op in plan.ops()]
            self._walk_plans[key] = (plan, op_counts(ops),
                                     copy_bytes(ops, self.executor.layer_blob_bytes))
        return self._walk_plans[key]

    def _run_walk(self, T: int, stats: Stats, start: int | None, tail: list[Op]) -> None:
        key = (T, self.gather_one, start)
        if not (self.executor.routed_gathers and self.cfg.prefill_stream in (None, "auto")
                and self.streams.wants_routing(T)):
            self._run_planned(T, stats, key, tail)
            return
        self._after_chunk.append(with_routing(
            stats, self.executor, self.spec, lambda: self._run_planned(T, stats, key, tail),
            lambda _, nbytes: self.streams.observe(T, nbytes)))

    def _run_planned(self, T: int, stats: Stats, key: WalkKey, tail: list[Op]) -> None:
        """A plan made before the chunk runs (the walk, or the decode plan): plain launches
        the first time its key is seen (timed), a captured replay the second (timed), then
        whichever was faster; `tail` (its Logits) enqueued live after it."""
        ex = self.executor
        plan, counts, copied = self._planned(key)
        trial = self.graph_trials.setdefault(key, {})
        replay: Replay | None = None
        if ex.can_capture and "plain" in trial and trial.get("choice") != "plain":
            replay = self._replay_for(key, plan, trial)
        t0 = time.perf_counter()
        if replay is None:
            for lp in plan.layers:
                tl = time.perf_counter()
                ex.execute(lp.ops, stats, None)
                self.layer_host_s.append(time.perf_counter() - tl)
                stats.layer_done(lp.layer)
            stats.host_s += time.perf_counter() - t0
            if ex.can_capture and "plain" not in trial:
                ex.synchronize()
                trial["plain"] = time.perf_counter() - t0
        else:
            ex.replay(replay)
            stats.host_s += time.perf_counter() - t0
            for lp in plan.layers:
                stats.layer_done(lp.layer)
            if "graph" not in trial:
                ex.synchronize()
                trial["graph"] = time.perf_counter() - t0
                trial["choice"] = "graph" if trial["graph"] < trial["plain"] else "plain"
        ex.execute(tail, stats, None)
        add_counts(stats, counts, copied)  # the walk reads nothing back
        if stats.routing_counts is not None:
            ex.collect_walk_routing(stats)
        self.last_plan = plan

    def _replay_for(self, key: WalkKey, plan: ChunkPlan,
                    trial: dict[str, Any]) -> Replay | None:
        if key not in self._replays:
            try:
                self._replays[key] = self.executor.capture(
                    op for lp in plan.layers for op in lp.ops)
            except Exception as e:  # a refused capture must not lose the prompt
                kind = {ROUTED: "routed plan", ROUTED_WALK: "routed walk"}.get(str(key[1]), "walk")
                what = "decode step" if key in DECODE_KEYS else f"{key[0]}-token {kind}"
                log.warning("capture of the %s failed (%s); launching it op by op", what, e)
                # a routed walk switches its copies only inside a graph: auto stops taking it
                self._switches_failed |= key[1] == ROUTED_WALK
                trial["choice"] = "plain"
                trial["error"] = str(e)
                return None
        return self._replays[key]

    def close(self) -> None:
        """Frees the captured replays (before the executor's device memory goes)."""
        for replay in self._replays.values():
            replay.free()
        self._replays.clear()
