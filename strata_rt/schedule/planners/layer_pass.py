"""The layer pass: a prompt longer than one chunk runs layer by layer over all its chunks, so each
layer's non-resident experts cross PCIe once per prompt instead of once per chunk.

Chunk order runs chunk 0 through every layer, then chunk 1, and so on: every chunk streams the
whole non-resident model again (a 30,118-token prompt in 8K chunks streams it four times). The
attention of chunk c at layer l needs only layer l's keys and values of chunks <= c, so the
order can as well be layer-major: layer l runs chunk 0, 1, ..., n-1 (each through its
Attention, routing, gathers, products and combine), while its streamed experts stay in the
walk's ring, and only then does the ring take the next layer's experts. The executor holds the
residual of every row of the prompt; `PromptRows` ops say which chunk's rows the ops after them
act on. Chunk boundaries are the ordinary order's, so each chunk's arithmetic is the same and
the output is too (tested byte for byte on the reference backend).

Ring: the walk's (planner.plan_walk) issuer and consumer rules, with the layer's chunks before
its last holding their slots (RingBuilder.hold): only the last chunk's gathers record `used`
and Consume. So a layer's streamed experts must fit the ring at once (`ring_need`); where the
ring also holds the next layer's, those copies run during the whole layer (they are issued as
the layer before releases its slots), else they start as the last chunk frees slots. Streamed
dense weights are copied once per layer: every chunk's Attention reads the slot, and the last
one frees it (DenseSchedule.attention / layer_done).

Not for: a routed walk (long chunks route nearly every expert), a layer split's parts, and
logits of every position (a perplexity run keeps the chunk order, whose logits leave chunk by
chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...errors import StrataError
from ..plan import ChunkInput, ChunkPlan, LayerPlan, LogitRows, Op, PromptRows
from ..plan_keys import WalkKey
from .ring_builder import RingBuilder, groups_of

if TYPE_CHECKING:
    from ...weights.model import MoESpec
    from ..executor import Executor
    from ..vram.image_cache import ImageCache
    from ..vram.residency import Residency
    from .dense_schedule import DenseSchedule

#: the gather-mode field of a layer pass's plan key (pass_key)
LAYER_PASS = "layer_pass"


def windows(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(first row, rows) of each chunk of a `tokens`-row prompt in chunks of `chunk` rows."""
    if tokens < 1 or chunk < 1:
        raise ValueError(f"a prompt of {tokens} rows in chunks of {chunk}")
    return [(lo, min(chunk, tokens - lo)) for lo in range(0, tokens, chunk)]


def ring_need(residency: Residency, layers: Sequence[int]) -> int:
    """Ring slots a layer pass needs: the most non-resident experts of one layer."""
    streamed = (~residency.mask()).sum(axis=1)
    return int(max((int(streamed[layer]) for layer in layers), default=0))


def streams_experts(residency: Residency, layers: Sequence[int]) -> bool:
    """Whether any expert of `layers` streams (else a pass would copy nothing either way)."""
    return bool(np.any(~residency.mask()[list(layers)]))


def plan_layer_pass(spec: MoESpec, residency: Residency, ring_slots: int, gather_one: bool,
                    start: int, chunks: Sequence[tuple[int, int]],
                    attention: DenseSchedule, images: ImageCache | None = None,
                    lanes: int = 1, in_place: bool = False) -> ChunkPlan:
    """A whole model's prompt at absolute position `start`, its `chunks` ((first row, rows),
    windows()) run layer by layer. attention: the dense schedule (its own start unused: each
    chunk's Attention names the chunk's); images, lanes and in_place as for plan_walk (the
    same for every chunk)."""
    span = range(spec.n_layers)
    need = ring_need(residency, span)
    if ring_slots < need:
        raise ValueError(f"ring_slots={ring_slots}: a layer pass holds a layer's streamed "
                         f"experts in the ring at once, and a layer here streams {need}")
    if len(chunks) < 1:
        raise ValueError("a layer pass needs at least one chunk")
    b = RingBuilder(residency, ring_slots, gather_one, lanes, in_place)
    b.seq = [(layer, e) for layer in span for e in range(spec.n_experts)
             if residency.slot(layer, e) is None]
    b.ops.extend(attention.chunk_ops())
    b.issue_available()  # the copies do not wait for the prompt's input
    layers = []
    all_experts = list(range(spec.n_experts))
    tokens = sum(n for _, n in chunks)
    for layer in span:
        first_entry = b.next_entry
        for c, (lo, n) in enumerate(chunks):
            b.hold = c < len(chunks) - 1
            b.next_entry = first_entry  # every chunk gathers the layer's entries again
            ops: list[Op] = [PromptRows(lo, n)]
            if layer == span[0]:
                ops.append(ChunkInput(attention.input_kind))
            b.ops.extend(ops + attention.attention(layer, start + lo))
            b.begin_layer(layer)
            for g, experts in enumerate(groups_of(all_experts)):
                b.group(layer, g, experts, None if images is None else images.index(layer, g))
            b.end_layer(layer)
        b.ops.extend(attention.layer_done(layer))
        layers.append(LayerPlan(layer, b.take_ops()))
    return ChunkPlan(tokens, "layer_pass", ring_slots, layers)


def pass_key(tokens: int, chunk: int, gather_one: bool, start: int) -> WalkKey:
    """The driver's plan (and CUDA graph) key of a layer pass: the prompt's rows, its chunk
    size and gather mode, its position."""
    return (tokens, f"{LAYER_PASS}:{chunk}:{int(gather_one)}", start)


def pass_of(key: WalkKey) -> tuple[int, bool] | None:
    """(chunk size, gather_one) of a layer pass's key; None for any other key."""
    mode = key[1]
    if not (isinstance(mode, str) and mode.startswith(LAYER_PASS + ":")):
        return None
    _, chunk, gather_one = mode.split(":")
    return int(chunk), gather_one == "1"


#: why a layer split takes no layer pass
SPLIT_REFUSAL = "a layer split runs each device's layers chunk by chunk"


def stream_refusal(prefill_stream: str) -> str:
    """Why a prefill_stream that streams routed experts takes no layer pass."""
    return (f"prefill_stream {prefill_stream} streams each chunk's routed experts, and a layer "
            "pass streams through the walk's ring")


def pass_refusal(ex: Executor, residency: Residency, tokens: int, chunk: int,
                 walks: bool, prefill_stream: str | None, split: bool) -> str | None:
    """Why this prompt cannot run as a layer pass on `ex` (None: it can). walks: whether its
    chunks take the streamed walk (planner.takes_walk)."""
    if split:
        return SPLIT_REFUSAL
    if prefill_stream not in (None, "auto", "walk"):
        return stream_refusal(prefill_stream)
    if not walks:
        return f"chunks of {chunk} tokens take the staging ring, not the walk"
    if ex.pass_tokens < tokens:
        return (f"the {ex.name} backend holds {ex.pass_tokens} prompt rows for a layer pass "
                f"and this prompt has {tokens}" + ("" if ex.pass_tokens else
                                                  " (it was opened under prefill_order "
                                                  "chunks, or its memory had no room for the "
                                                  "prompt's residual: see the warning)"))
    need = ring_need(residency, range(residency.n_layers))
    if ex.walk_slots < need:
        return (f"the walk's ring holds {ex.walk_slots} expert slots and a layer streams "
                f"{need} experts, which a layer pass keeps in the ring at once: give the ring "
                "more room (ring_mib) or keep more experts resident")
    return None


def takes_layer_pass(order: str | None, prefill_stream: str | None, ex: Executor,
                     residency: Residency, tokens: int, chunk: int, start: int | None,
                     logits: LogitRows | None, walks: bool, split: bool) -> bool:
    """Whether a whole model's prompt of `tokens` rows in chunks of `chunk` runs as a layer
    pass: never under prefill_order "chunks", for one chunk, or for logits of every row
    (they leave chunk by chunk); "layers" takes it or raises StrataError saying why it
    cannot (pass_refusal); "auto" takes it where it can and experts stream (else the order
    changes nothing but memory). order, prefill_stream: the engine config's."""
    order = order or "chunks"
    if order == "chunks" or start is None or tokens <= chunk or logits == "all":
        return False
    why = pass_refusal(ex, residency, tokens, chunk, walks, prefill_stream, split)
    if why is not None and order == "layers":
        raise StrataError(f"prefill_order layers: {why}")
    return why is None and (order == "layers"
                            or streams_experts(residency, range(residency.n_layers)))


def order_refusal(prefill_order: str | None, prefill_stream: str | None,
                  devices: Sequence[int], given: set[str]) -> str | None:
    """Why prefill_order "layers" cannot run whatever the prompt (pass_refusal's reasons
    known before any prompt runs; `given`: the fields the caller set, not from switches),
    else None: EngineConfig.resolve refuses it then, before any prompt has run."""
    if prefill_order != "layers":
        return None
    order = "prefill_order" if "prefill_order" in given else "STRATA_PREFILL_ORDER"
    stream = "prefill_stream" if "prefill_stream" in given else "STRATA_PREFILL_STREAM"
    if prefill_stream in ("routed", "routed_walk"):
        why = (f"{stream_refusal(prefill_stream)} ({order}: layers, {stream}: "
               f"{prefill_stream})")
    elif len(devices) > 1:
        why = f"{SPLIT_REFUSAL} ({order}: layers, devices: {','.join(map(str, devices))})"
    else:
        return None
    return f"prefill_order layers: {why}; with it, prefill_order takes chunks or auto"
