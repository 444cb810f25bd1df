"""Device memory of a whole model's dense part, as pure Python: what memory_plan adds to the
CUDA backend's arena beside the experts, and how one layer's dense weights sit in a slot.

The dense weights stay in their GGUF types on the device (a Q4_K_M file's Q4_K and Q6_K
attention and head take their file bytes in VRAM and over PCIe when they stream); a GGML
dequantizing gather (strata_rt.gemm.ggml_gather) turns them into the fp16 operands of the GEMMs
where they are used. The decoded values are fp16 (round to nearest even) of
gguf.quants.dequantize's float32 value, the fp16 matrices an fp16 upload of the dequantized
weights would hold, so the type a weight is stored in changes VRAM, never the GEMM's operands.

A dense layer slot holds the q, k and v projections back to back in their types (one block
row after another: an F16 trio is then itself the fp16 Wqkv [q_dim + 2 kv_dim, hidden] the
GEMM reads in place), then, 256-byte aligned, Wo [hidden, q_dim] in its type and the float32
norm weights attn_norm [hidden], q_norm and k_norm [head_dim]. Layers may differ in type, so
each has its own offsets; resident layers are packed by their own sizes, a streaming ring's
slots are the largest layer's.

Fixed regions: the dense slots (every layer's when resident; a ring of DENSE_RING_SLOTS when
they stream), the head (output_norm, Wout [vocab, hidden] in its type), the token embedding in
its type (on the device that looks the chunk's token ids up; none when the head is tied to it
and on that device, whose bytes then serve both), the dense scratch, the
RoPE tables [context, head_dim / 2] of cos and sin, the KV cache (fp16, n_layers x 2 x
context x kv_dim) and the split decode attention's float32 parts (n_heads x splits x
(head_dim + 2), where the layout has split kernels). The dense scratch is one fp16 buffer the
compute stream decodes into before
each GEMM whose weight is not F16: a layer's Wqkv, then its Wo, and at the end HEAD_SLICE_ROWS
rows of the head at a time. Attention and Logits ops run in stream order on the compute stream,
so one buffer, sized for the largest of these, serves them all. Per chunk: the normed rows,
q/k/v, q after RoPE, the attention output, the head's scratch (at most LOGIT_ROWS rows per
output GEMM), the dense GEMM's workspace (cuBLAS's, or the fp32 scratch of the
batch-invariant "own" GEMM, which grows with the chunk) and the chunk's int32 token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...backends.cuda.attention.shapes import decode_part_bytes, decode_supported
from ...backends.cuda.dense.kernels import workspace_bytes
from ...backends.cuda.sampling_kernels import ARGMAX_RESULT, sampler_bytes
from ...formats.ggml_types import NAMES
from ...runtime.memory import align_up
from ...schedule.planners.dense_schedule import DENSE_RING_SLOTS
from .spec import Qwen3Spec
from .weights import tensor_name

if TYPE_CHECKING:
    from .weights import Qwen3Model

#: rows of the output head one GEMM computes (all-position logits go in slices of this many)
LOGIT_ROWS = 64
#: vocabulary rows of a head not stored as F16 that are decoded to fp16 per GEMM: the head's
#: fp16 image in VRAM is at most this many rows
HEAD_SLICE_ROWS = 16384
#: the type whose matrices the GEMMs read in place (no decode, no scratch)
DIRECT = "F16"
_ALIGN = 256


def tensor_bytes(type_name: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] matrix stored as GGML type `type_name` (whole blocks per row)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ...errors import FormatError

    try:
        values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    except KeyError:
        raise FormatError(f"unknown GGML type {type_name!r}") from None
    if cols % values:
        raise FormatError(f"{type_name}: rows of {cols} values are not whole "
                          f"{values}-value blocks")
    return rows * (cols // values) * nbytes


@dataclass(frozen=True)
class LayerTypes:
    """The GGML type names of one layer's q, k, v and o projections."""

    q: str
    k: str
    v: str
    o: str


def gpu_decodes(type_name: str | None) -> bool:
    """Whether the GGML decoders (kernels/ggml) decode `type_name`: an embedding of another
    type (or of none known) is looked up on the host."""
    return type_name in NAMES


#: embedding types whose rows the host copies rather than decodes
PLAIN_TYPES = frozenset({"F32", "F16", "BF16"})


def embeds_on_gpu(mode: str, type_name: str | None, shares_head: bool) -> bool:
    """Whether the device holds a whole model's embedding and looks the token ids up
    (EngineConfig.embedding `mode`). "device": every type the GGML decoders decode; "auto":
    those too, but a plain float type only when a tied head on the device holds its bytes
    anyway: its rows cost the host a copy, while in VRAM they would take expert slots (an F16
    embedding of the 235B shape is 1.2 GiB); "host": none."""
    if mode == "host" or not gpu_decodes(type_name):
        return False
    return mode == "device" or shares_head or type_name not in PLAIN_TYPES


@dataclass(frozen=True)
class DenseTypes:
    """The GGML type names of every dense matrix the GPU holds: each layer's projections, the
    output head (the embedding's type when the head is tied) and the embedding (None: not
    known, as when only the head's type was given; `tied`: the head is the embedding, so one
    copy in VRAM serves both)."""

    layers: tuple[LayerTypes, ...]
    head: str
    embd: str | None = None
    tied: bool = False

    @classmethod
    def uniform(cls, n_layers: int, type_name: str, tied: bool = False) -> DenseTypes:
        """Every matrix of one type (a synthetic model's `dense_type`)."""
        t = type_name.upper()
        return cls((LayerTypes(t, t, t, t),) * n_layers, t, t, tied)

    @classmethod
    def lookup(cls, n_layers: int, type_of: Callable[[str], str | None]) -> DenseTypes:
        """From type_of(GGUF tensor name) -> type name, None for an absent tensor (a file's
        header: `output.weight` absent means the head is the embedding)."""
        def get(role: str, layer: int | None = None) -> str:
            t = type_of(tensor_name(role, layer))
            if t is None:
                raise KeyError(tensor_name(role, layer))
            return t

        layers = tuple(LayerTypes(get("attn_q", i), get("attn_k", i), get("attn_v", i),
                                  get("attn_output", i)) for i in range(n_layers))
        head, embd = type_of(tensor_name("output")), get("token_embd")
        return cls(layers, embd if head is None else head, embd, head is None)

    @classmethod
    def of_model(cls, whole: Qwen3Model) -> DenseTypes:
        layers = tuple(LayerTypes(lw.attn_q.type_name, lw.attn_k.type_name,
                                  lw.attn_v.type_name, lw.attn_output.type_name)
                       for lw in whole.dense.layers)
        return cls(layers, whole.output_weight.type_name, whole.dense.token_embd.type_name,
                   whole.tied)


@dataclass(frozen=True)
class DenseSlot:
    """Byte offsets of one layer's dense weights inside its slot, and their types."""

    types: LayerTypes
    q: int
    k: int
    v: int
    o: int
    attn_norm: int
    q_norm: int
    k_norm: int
    nbytes: int

    @property
    def qkv_direct(self) -> bool:
        """q, k and v are F16: the slot's q..v bytes are the fp16 Wqkv the GEMM reads."""
        t = self.types
        return t.q == t.k == t.v == DIRECT

    @property
    def o_direct(self) -> bool:
        return self.types.o == DIRECT

    @classmethod
    def of(cls, spec: Qwen3Spec, types: LayerTypes) -> DenseSlot:
        H, hd, qd, kvd = spec.hidden, spec.head_dim, spec.q_dim, spec.kv_dim
        q = tensor_bytes(types.q, qd, H)
        k = tensor_bytes(types.k, kvd, H)
        v = tensor_bytes(types.v, kvd, H)
        at = {"q": 0, "k": q, "v": q + k}
        sizes = [("o", tensor_bytes(types.o, H, qd)), ("attn_norm", H * 4),
                 ("q_norm", hd * 4), ("k_norm", hd * 4)]
        end = q + k + v
        for name, size in sizes:
            at[name] = align_up(end, _ALIGN)
            end = at[name] + size
        return cls(types=types, nbytes=align_up(end, _ALIGN), **at)


@dataclass(frozen=True)
class DenseLayout:
    """Every layer's slot, where resident layers sit, and the dense scratch's size."""

    slots: tuple[DenseSlot, ...]
    head_type: str

    @classmethod
    def of(cls, spec: Qwen3Spec, types: DenseTypes) -> DenseLayout:
        if len(types.layers) != spec.n_layers:
            raise ValueError(f"dense types of {len(types.layers)} layers for "
                             f"n_layers={spec.n_layers}")
        return cls(tuple(DenseSlot.of(spec, t) for t in types.layers), types.head)

    @property
    def slot_bytes(self) -> int:
        """A streaming ring slot: the largest layer's."""
        return max(s.nbytes for s in self.slots)

    def resident_offset(self, layer: int) -> int:
        """Where layer `layer` starts in the resident dense region (layers packed in order)."""
        return sum(s.nbytes for s in self.slots[:layer])

    @property
    def resident_bytes(self) -> int:
        return self.resident_offset(len(self.slots))

    @property
    def head_direct(self) -> bool:
        return self.head_type == DIRECT

    def scratch_bytes(self, spec: Qwen3Spec, head: bool = True) -> int:
        """The fp16 scratch: the largest of a decoded Wqkv, a decoded Wo and a decoded head
        slice, counting only what some weight not stored as F16 needs (0: none does).
        head False: a split part before the last, which holds no head."""
        H, qd, kvd = spec.hidden, spec.q_dim, spec.kv_dim
        need = [0]
        if not all(s.qkv_direct for s in self.slots):
            need.append((qd + 2 * kvd) * H * 2)
        if not all(s.o_direct for s in self.slots):
            need.append(H * qd * 2)
        if head and not self.head_direct:
            need.append(min(spec.vocab, HEAD_SLICE_ROWS) * H * 2)
        return max(need)


@dataclass(frozen=True)
class WholeSizing:
    """What a whole model's device memory depends on besides the chunk: the model and its
    dense types, the KV positions, whether the dense weights stream, and the dense GEMM
    ("cublas" or "own")."""

    spec: Qwen3Spec
    types: DenseTypes
    context: int
    dense_stream: bool = False
    gemm: str = "cublas"
    #: whether the output head is on this device (a layer split: the last part only; the
    #: others' `spec` counts their own layers and `types` holds theirs)
    head: bool = True
    #: whether this device would look the chunk's token ids up in the embedding (the first
    #: part of a split; False: the host decodes the rows, EngineConfig.embedding "host")
    embedding: bool = True
    #: EngineConfig.embedding ("auto", "device"): which types the device looks up itself
    embedding_mode: str = "device"

    def streamed(self) -> WholeSizing:
        return replace(self, dense_stream=True)

    @property
    def embeds(self) -> bool:
        """Whether the device holds the embedding and decodes its rows: asked to, and of a
        type `embeds_on_gpu` takes."""
        return self.embedding and embeds_on_gpu(self.embedding_mode, self.types.embd,
                                                self.types.tied and self.head)

    @property
    def embd_in_head(self) -> bool:
        """Whether the rows are read from the head region (a tied head on this device)."""
        return self.embeds and self.types.tied and self.head

    def layout(self) -> DenseLayout:
        return DenseLayout.of(self.spec, self.types)


def kv_bytes(spec: Qwen3Spec, context: int) -> int:
    """fp16 keys and values of every layer for `context` positions."""
    return spec.n_layers * 2 * context * spec.kv_dim * 2


def whole_fixed_regions(w: WholeSizing) -> dict[str, int]:
    """Regions that depend on the model and the context, not on the chunk."""
    spec, context = w.spec, w.context
    layout = w.layout()
    dense = DENSE_RING_SLOTS * layout.slot_bytes if w.dense_stream else layout.resident_bytes
    return {
        "dense": dense,
        "head_norm": spec.hidden * 4 if w.head else 0,
        "head": tensor_bytes(w.types.head, spec.vocab, spec.hidden) if w.head else 0,
        # the embedding in its type, unless the tied head's bytes serve it (or the host looks
        # the rows up)
        "embd": (tensor_bytes(w.types.embd, spec.vocab, spec.hidden)
                 if w.embeds and w.types.embd is not None and not w.embd_in_head else 0),
        "dense_scratch": layout.scratch_bytes(spec, w.head),  # 0 when every matrix is F16
        "rope_cos": context * spec.head_dim // 2 * 4,
        "rope_sin": context * spec.head_dim // 2 * 4,
        "kv": kv_bytes(spec, context),
        "position": 16,  # the chunk's start, read by a decode step replayed as a graph
        # the split attention's parts in a one-token chunk (float32 per head and split)
        "decode_part": (decode_part_bytes(spec.n_heads, spec.head_dim)
                        if decode_supported(spec.n_heads, spec.n_kv_heads, spec.head_dim)
                        else 0),
        # a decode step's token taken on the device (DeviceArgmax, DeviceSampler)
        "argmax_result": ARGMAX_RESULT if w.head else 0,
        "sample_seen": sampler_bytes(context)[0] if w.head else 0,
        "sample_out": sampler_bytes(context)[1] if w.head else 0,
    }


def dense_workspace_bytes(w: WholeSizing, tokens: int) -> int:
    """The dense GEMM's workspace for chunks of up to `tokens` (the largest of its GEMMs)."""
    spec = w.spec
    head = workspace_bytes(w.gemm, LOGIT_ROWS, spec.vocab) if w.head else 0
    return max(workspace_bytes(w.gemm, tokens, max(spec.q_dim + 2 * spec.kv_dim, spec.hidden)),
               head)


def whole_chunk_regions(w: WholeSizing, tokens: int) -> dict[str, int]:
    """Regions one chunk of `tokens` needs for attention and the head."""
    spec, T = w.spec, tokens
    return {
        "dense_ws": dense_workspace_bytes(w, T),
        "xa": T * spec.hidden * 2,
        "qkv": T * (spec.q_dim + 2 * spec.kv_dim) * 2,
        "q_rot": T * spec.q_dim * 2,
        "attn_out": T * spec.q_dim * 2,
        "head_in": LOGIT_ROWS * spec.hidden * 2 if w.head else 0,
        "head_out": LOGIT_ROWS * spec.vocab * 4 if w.head else 0,
        "token_ids": T * 4 if w.embeds else 0,  # the chunk's ids, uploaded for the lookup
    }
