"""What a CUDA backend takes and fills at open, in order: its formats' kernels, the memory
plan (chunk size, resident experts, lanes, dense policy) within the free VRAM, the arena, and
the weights that stay on the device (router, norms, resident experts, image blocks, a whole
model's dense part). Its own module so the executor keeps to running plans; a layer split's
part sizes every per-layer region for its own layers (split_part.part_moe_spec)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ...errors import BudgetError
from ...models.qwen3.whole_memory import DenseTypes, WholeSizing, gpu_decodes
from ...runtime.memory import MIB
from ...schedule.planners.dense_schedule import DENSE_RING_SLOTS
from ...schedule.planners.planner import ring_sizes
from ...schedule.vram.image_cache import ImageCache, capacity_blocks
from ...schedule.vram.in_place import check_in_place
from ...schedule.vram.memory_plan import (
    DEFAULT_RESERVE_MIB,
    PASS_ORDERS,
    MemoryPlan,
    plan_lanes,
    plan_memory,
)
from ...schedule.vram.residency import Residency
from .device_state import DeviceState
from .layer_kernels import LayerKernels
from .split_part import part_moe_spec, part_whole

if TYPE_CHECKING:
    from ...config.settings.engine_config import EngineConfig
    from ...formats.contract import FormatKernels
    from ...models.qwen3.weights import Qwen3Model
    from ...runtime.device import Runtime
    from ...schedule.plan import InputKind
    from ...schedule.split import Part
    from ...schedule.vram.in_place import InPlaceSetting
    from ...weights.model import Model
    from ...weights.store import ExpertStore
    from .dense.host_store import HostMemory
    from .whole import CudaWhole

log = logging.getLogger(__name__)



@dataclass
class OpenedDevice:
    """What open_device filled, for the backend to hold."""

    fks: list[FormatKernels]
    in_place: InPlaceSetting
    kv_capacity: int
    lanes: int
    dense_ring: int | None
    residency: Residency
    images: ImageCache
    walk_slots: int
    tokens: int
    memory: MemoryPlan
    dev: DeviceState
    kernels: LayerKernels
    whole: CudaWhole | None
    #: what the backend's chunks bring (schedule.executor.Executor.input_kind)
    input_kind: InputKind = "hidden"
    #: prompt rows a layer pass can hold (0: none; with_pass)
    pass_tokens: int = 0


def open_device(rt: Runtime, model: Model, store: ExpertStore, cfg: EngineConfig, part: Part,
                whole: Qwen3Model | None, residency: Residency | None,
                host: HostMemory) -> OpenedDevice:
    """A backend's device state on rt (current); residency None: derived from the budget.
    host: the engine's host context, which lends a whole model's streamed dense layers their
    host store as it lent the experts theirs (the same store_memory)."""
    spec, lay, fmt = model.spec, model.layout, model.fmt
    lspec, lo, hi = part_moe_spec(spec, part), part.first, part.end
    routing = cfg.routing
    assert routing is not None, "EngineConfig.resolve() sets routing"
    # kernels first: a format without kernels fails before any memory is taken; a mixed
    # model loads each distinct layer format's kernels once
    fks = model.formats.kernels(rt)
    in_place = check_in_place(cfg.in_place, model.formats.in_place_format)
    reserve = cfg.vram_reserve_mib if cfg.vram_reserve_mib is not None else DEFAULT_RESERVE_MIB
    available = rt.free_bytes() - int(reserve * MIB)
    slot = lay.slot_bytes
    fixed_res = residency.n_slots if residency is not None else None
    rings = ring_sizes(cfg.ring_bytes, slot, lspec.total_experts - (fixed_res or 0))
    whole_sizes = None
    kv_capacity = 0
    if whole is not None:
        assert cfg.dense_gemm is not None, "EngineConfig.resolve() sets dense_gemm"
        kv_capacity = cfg.context or whole.spec.context
        wspec, types = part_whole(whole.spec, DenseTypes.of_model(whole), part)
        # the first part looks the chunk's token ids up (the others receive the residual)
        whole_sizes = WholeSizing(wspec, types, kv_capacity, False, cfg.dense_gemm,
                                  head=part.last,
                                  embedding=not part.receives and cfg.embedding != "host",
                                  embedding_mode=cfg.embedding or "auto")
        if whole_sizes.embedding and not whole_sizes.embeds:
            log.info("token embedding %s: its rows are decoded on the host (%s)", types.embd,
                     "no GPU decoder for the type" if not gpu_decodes(types.embd) else
                     "a plain float type the head does not share; STRATA_EMBEDDING=device "
                     "keeps it on the GPU")
    image_room = capacity_blocks(cfg.image_cache_mib, spec, lay)
    assert cfg.compute_lanes is not None, "EngineConfig.resolve() sets compute_lanes"
    lanes, mp = plan_lanes(cfg.compute_lanes, fixed_res, lspec.total_experts, partial(
        plan_memory, lspec, lay, fmt.activation, available, rings.total, cfg.prefill,
        fixed_res, routing, whole_sizes, cfg.dense, image_room))
    if whole_sizes is not None and part.n_parts == 1 and cfg.prefill_order in PASS_ORDERS:
        mp = with_pass(mp, kv_capacity, partial(
            plan_memory, lspec, lay, fmt.activation, available, rings.total, mp.tokens,
            fixed_res, routing, whole_sizes, "stream" if mp.dense_stream else "resident",
            image_room, lanes))
    #: dense ring slots when a whole model's dense weights stream (the driver plans them)
    dense_ring = DENSE_RING_SLOTS if mp.dense_stream else None
    if residency is None:
        residency = Residency.from_budget(model, mp.n_resident, cfg.load_profile())
        # the ring was sized for everything streaming; plan with what actually streams
        rings = ring_sizes(cfg.ring_bytes, slot, lspec.total_experts - residency.n_slots)
    images = ImageCache.choose(spec, residency, image_room)
    if cfg.image_cache_mib:
        images.report(spec, lay)
    dev = DeviceState(rt, mp.regions, max(available, 0),
                      mp.tokens * spec.hidden * 4, (lspec.n_layers, spec.n_experts + 1), lanes,
                      mp.tokens, cfg.copy_streams)
    try:  # the arena is freed here if filling it fails (the backend holds nothing yet)
        kernels = LayerKernels(rt, spec, fmt.activation, dev.ptr, routing, lo)
        # poison everything first: a read of bytes nobody wrote shows up as NaN, not as luck
        rt.memset_d8(dev.arena.base_ptr, 0xFF, dev.arena.total, dev.copy)
        # weights that stay on the device, and the resident experts (once, at open)
        router = kernels.router_weights(model.router[lo:hi])  # alive until the sync
        norm = np.ascontiguousarray(model.norm[lo:hi])
        rt.memcpy_htod(dev.ptr["router"], router, dev.copy)
        rt.memcpy_htod(dev.ptr["norm"], norm, dev.copy)
        for i, (layer, e) in enumerate(residency.pairs):
            off = store.offset(layer, e)
            rt.memcpy_htod(dev.ptr["resident"] + i * slot,
                           store.arena[off: off + model.formats.layout(layer).blob_bytes],
                           dev.copy)
        dev.copy.synchronize()
        dev.fill_images(images, spec, residency, fks, lay)
        cuda_whole = None
        if whole is not None:
            from .whole import CudaWhole

            assert whole_sizes is not None
            sizing = whole_sizes.streamed() if mp.dense_stream else whole_sizes
            attention, dense, argmax = cfg.decode_attention, cfg.decode_dense, cfg.decode_argmax
            assert attention and dense and argmax, "EngineConfig.resolve() sets them"
            assert cfg.prefill_attention, "EngineConfig.resolve() sets it"
            cuda_whole = CudaWhole(rt, whole, dev.ptr, mp.regions["dense_ws"], sizing, dev.copy,
                                   host, lo, attention, dense, argmax, cfg.prefill_attention)
    except BaseException:
        dev.close()
        raise
    kind: InputKind = "tokens" if whole_sizes is not None and whole_sizes.embeds else "hidden"
    return OpenedDevice(fks, in_place, kv_capacity, lanes, dense_ring, residency, images,
                        rings.walk, mp.tokens, mp, dev, kernels, cuda_whole, kind,
                        mp.pass_tokens)


def with_pass(mp: MemoryPlan, rows: int, plan: Callable[..., MemoryPlan]) -> MemoryPlan:
    """`mp` redone with room for a layer pass of `rows` prompt rows (the KV cache's
    positions: memory_plan.pass_regions) at mp's chunk size, lanes and dense policy;
    plan(pass_tokens=...) is plan_memory with those fixed. Where a fixed residency leaves no
    room for it, `mp` as it was (its pass_tokens 0: the driver reports that a pass cannot
    run). Under the reserve policy the residual takes room from the resident experts."""
    try:
        return plan(pass_tokens=rows)
    except BudgetError as e:
        log.warning("prefill_order: no room for a layer pass over %d prompt rows (%s); "
                    "prompts run chunk by chunk", rows, e)
        return mp
