"""The CUDA backend's device memory plan, as pure Python: which regions one device arena
holds for a model, a chunk size and a residency, and how a VRAM budget splits between the
chunk's buffers and resident experts.

Config validation and `strata inspect` size budgets with the same function the backend
allocates with, without importing anything that needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...backends.cuda.routing.kernels import ROUTER_BYTES, workspace_bytes
from ...errors import BudgetError
from ...formats.activations import Activation
from ...formats.contract import MMQ_GROUP, ExpertLayout
from ...models.qwen3.whole_memory import WholeSizing, whole_chunk_regions, whole_fixed_regions
from ...runtime.memory import mib, plan_regions, regions_total
from ..plan import LANES, StreamName, lane_index
from ..planners.planner import AUTO_CHUNK_MAX, RESERVE_AUTO_CHUNK_MAX
from .image_cache import block_bytes
from .lanes import LanesSetting, allocated_lanes

if TYPE_CHECKING:
    from ...weights.model import MoESpec

#: `prefill: auto` tries chunk sizes in steps of this many tokens below the maximum
AUTO_CHUNK_STEP = 64
#: VRAM left free when the config names no reserve (driver, modules, other processes)
DEFAULT_RESERVE_MIB = 512
#: bytes of one entry of the expert and products tables (a blob's device address;
#: plan.RoutedExperts, plan.LayerProducts)
EXPERT_TABLE_ENTRY = 8


def chunk_regions(spec: MoESpec, activation: Activation, tokens: int,
                  routing: str = "exact") -> dict[str, int]:
    """Device bytes of one chunk's buffers (all sorted rows are tokens * top_k)."""
    T, H, F, E, K = tokens, spec.hidden, spec.ffn, spec.n_experts, spec.top_k
    rows = T * K
    extra = {"route_ws": workspace_bytes(T, E, routing)} if routing != "fp32" else {}
    return {**extra,
        "x": T * H * 4,
        "xn": T * H * 4,
        "logits": T * E * 4,
        "topk_ids": rows * 4,
        "topk_w": rows * 4,
        "sorted_token": rows * 4,
        "row_of": rows * 4,
        "act_hidden": activation.nbytes(rows, H),
        "act_ffn": activation.nbytes(rows, F),
        "gate_up_out": rows * 2 * F * 4,
        "down_out": rows * H * 4,
    }


#: the prefill orders (EngineConfig.prefill_order) under which a whole model's device arena
#: holds a layer pass's residual (pass_regions); the config's budget check reads them too
PASS_ORDERS = ("layers", "auto")


def pass_chunks(pass_tokens: int, tokens: int) -> int:
    """Chunks of `tokens` rows a layer pass of up to `pass_tokens` rows is cut into."""
    return -(-pass_tokens // max(tokens, 1))


def pass_regions(hidden: int, tokens: int, pass_tokens: int) -> dict[str, int]:
    """Device bytes a layer pass (schedule.planners.layer_pass) of up to `pass_tokens` prompt
    rows adds to a whole model's arena: the residual of every row of the prompt (float32, `pass_x`),
    and one RMSNorm flag word per chunk of `tokens` rows (`pass_flags`: each chunk's rows
    are numbered from its own first row). Empty without a pass."""
    if pass_tokens <= 0:
        return {}
    return {"pass_x": pass_tokens * hidden * 4,
            "pass_flags": pass_chunks(pass_tokens, tokens) * 8}


def lane_buffers(stream: StreamName) -> tuple[str, str]:
    """The regions of a compute lane's group buffers (gate/up images, down images)."""
    suffix = "" if lane_index(stream) == 0 else str(lane_index(stream) + 1)
    return f"gate_up_buf{suffix}", f"down_buf{suffix}"


def fixed_regions(spec: MoESpec, layout: ExpertLayout, ring_slots: int,
                  routing: str = "exact", image_blocks: int = 0,
                  lanes: int = 1) -> dict[str, int]:
    """Device bytes that do not depend on the chunk or the residency (the router weights take
    routing.kernels.ROUTER_BYTES[routing] bytes each; image_blocks: room of the
    image cache, strata_rt.schedule.vram.image_cache; lanes: compute lanes, each with its group
    buffers)."""
    L, H, E = spec.n_layers, spec.hidden, spec.n_experts
    images = {}
    if image_blocks:
        gu, dn = block_bytes(layout)
        images = {"image_gate_up": image_blocks * gu, "image_down": image_blocks * dn}
    buffers = {}
    for lane in LANES[:lanes]:
        gu_name, dn_name = lane_buffers(lane)
        buffers[gu_name] = MMQ_GROUP * layout.gate_up_image_bytes
        buffers[dn_name] = MMQ_GROUP * layout.down_image_bytes
    return {**images,
        "router": L * E * H * ROUTER_BYTES[routing],
        "norm": L * H * 4,
        "bounds": L * (E + 1) * 4,
        # per (layer, expert) the device address its blob is read at by a RoutedExperts
        "expert_table": L * E * EXPERT_TABLE_ENTRY,
        # the same for a LayerProducts (its resident slots): rows of its own, so no write of
        # them can touch the expert table a captured decode step reads, nor the reverse
        "products_table": L * E * EXPERT_TABLE_ENTRY,
        # one word: the earliest (layer << 32 | row) whose RMSNorm input is not finite
        "nonfinite": 8,
        "ring": ring_slots * layout.slot_bytes,
        **buffers,
    }


@dataclass(frozen=True)
class MemoryPlan:
    tokens: int
    n_resident: int
    regions: dict[str, int]
    #: a whole model's dense weights stream through a ring (they did not fit)
    dense_stream: bool = False
    #: prompt rows a layer pass can hold (pass_regions; 0: no room for one)
    pass_tokens: int = 0

    @property
    def total(self) -> int:
        return regions_total(plan_regions(self.regions))

    def describe(self) -> str:
        big = sorted(self.regions.items(), key=lambda kv: -kv[1])[:6]
        return ", ".join(f"{name} {mib(size)} MiB" for name, size in big)


def plan_memory(spec: MoESpec, layout: ExpertLayout, activation: Activation, available: int,
                ring_slots: int, prefill: str | int, n_resident: int | None,
                routing: str = "exact", whole: WholeSizing | None = None,
                dense: str = "auto", image_blocks: int = 0, lanes: int = 1,
                pass_tokens: int = 0) -> MemoryPlan:
    """plan_memory_for with a whole model's dense policy applied: "resident", "stream", or
    "auto" (resident when that plan fits, else streamed; a plan that fits either way keeps
    them resident, which copies nothing per chunk)."""
    def plan(w: WholeSizing | None) -> MemoryPlan:
        return plan_memory_for(spec, layout, activation, available, ring_slots, prefill,
                               n_resident, routing, w, image_blocks, lanes, pass_tokens)

    if whole is None or dense == "resident":
        return plan(whole)
    if dense == "stream":
        return plan(whole.streamed())
    try:
        return plan(whole)
    except BudgetError:
        return plan(whole.streamed())


def plan_memory_for(spec: MoESpec, layout: ExpertLayout, activation: Activation,
                    available: int, ring_slots: int, prefill: str | int,
                    n_resident: int | None, routing: str = "exact",
                    whole: WholeSizing | None = None, image_blocks: int = 0,
                    lanes: int = 1, pass_tokens: int = 0) -> MemoryPlan:
    """Sizes the device arena within `available` bytes.

    n_resident fixed (expert_cache): the residency is placed first and `prefill: auto` takes
    the largest chunk up to AUTO_CHUNK_MAX that fits beside it. n_resident None
    (vram_reserve_mib): the chunk comes first (auto: up to RESERVE_AUTO_CHUNK_MAX) and every
    byte left holds resident experts. Raises BudgetError naming the sizes when
    even the chunk asked for (or, for auto, one step of AUTO_CHUNK_STEP tokens) cannot fit.
    whole: a whole model's sizing adds its dense weights, head, RoPE tables, KV cache and
    per-chunk attention buffers (strata_rt.models.qwen3.whole_memory). image_blocks: room of the
    image cache, a fixed region placed before the chunk and the resident experts. lanes: compute
    lanes, each holding its own group buffers (strata_rt.schedule.vram.lanes). pass_tokens: a
    layer pass's prompt rows (pass_regions, beside the chunk): placed before the resident
    experts, so under the reserve policy they take room from them (the backend plans them at
    the chunk size already chosen, so `prefill: auto` is not shrunk for them)."""
    fixed = fixed_regions(spec, layout, ring_slots, routing, image_blocks, lanes)
    if whole is not None:
        fixed.update(whole_fixed_regions(whole))
    slot = layout.slot_bytes

    def plan(tokens: int, resident: int) -> MemoryPlan:
        regions = {**fixed, "resident": resident * slot,
                   **chunk_regions(spec, activation, tokens, routing)}
        if whole is not None:
            regions.update(whole_chunk_regions(whole, tokens))
        regions.update(pass_regions(spec.hidden, tokens, pass_tokens))
        return MemoryPlan(tokens, resident, regions,
                          whole is not None and whole.dense_stream, max(pass_tokens, 0))

    need_res = 0 if n_resident is None else n_resident
    if prefill == "auto":
        cap = AUTO_CHUNK_MAX if n_resident is not None else RESERVE_AUTO_CHUNK_MAX
        candidates = [cap] + list(range(
            cap // AUTO_CHUNK_STEP * AUTO_CHUNK_STEP - AUTO_CHUNK_STEP, 0, -AUTO_CHUNK_STEP))
        lo, hi = 0, len(candidates) - 1  # candidates descend; find the first that fits
        if plan(candidates[hi], need_res).total > available:
            tokens = candidates[hi]
        else:
            while lo < hi:
                mid = (lo + hi) // 2
                if plan(candidates[mid], need_res).total <= available:
                    hi = mid
                else:
                    lo = mid + 1
            tokens = candidates[lo]
    else:
        tokens = int(prefill)
    first = plan(tokens, need_res)
    if first.total > available:
        what = f"a {tokens}-token chunk"
        if n_resident:
            what += f" beside {n_resident} resident experts ({mib(n_resident * slot)} MiB)"
        raise BudgetError(
            f"device memory: {what} needs {mib(first.total)} MiB ({first.describe()}), "
            f"{mib(max(available, 0))} MiB available after the reserve; lower `prefill`, "
            "`ring_mib`, `expert_cache` or `image_cache_mib`, or lower `vram_reserve_mib`"
            + ("; `compute_lanes: 1` drops the second lane's group buffers" if lanes > 1 else ""))
    if n_resident is not None:
        return first
    spare = available - first.total
    resident = min(spec.n_layers * spec.n_experts, spare // slot)
    while resident > 0 and plan(tokens, resident).total > available:
        resident -= 1  # alignment padding can cost the last slot
    return plan(tokens, resident)


def plan_lanes(setting: LanesSetting, n_resident: int | None, total_experts: int,
               plan: Callable[[int], MemoryPlan]) -> tuple[int, MemoryPlan]:
    """The compute lanes an engine opens with and its memory plan; plan(lanes) is
    plan_memory for that many lanes, n_resident the fixed residency (None: the plan derives
    it). "1" and "2" are taken as given (a second lane that does not fit is a BudgetError).
    Under auto the second lane's buffers are kept only where they cost nothing else: every
    expert resides with one lane (strata_rt.schedule.vram.lanes.allocated_lanes), and the plan
    with two lanes still fits, with the same chunk and every expert resident."""
    if setting != "auto":
        lanes = int(setting)
        return lanes, plan(lanes)
    one = plan(1)

    def all_resident(mp: MemoryPlan) -> bool:
        return (mp.n_resident if n_resident is None else n_resident) >= total_experts

    if allocated_lanes(setting, all_resident(one)) < 2:
        return 1, one
    try:
        two = plan(2)
    except BudgetError:
        return 1, one
    if two.tokens < one.tokens or not all_resident(two):
        return 1, one
    return 2, two
