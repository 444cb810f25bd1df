"""Device memory of a whole model's dense part, as pure Python: what memory_plan adds to the
CUDA backend's arena beside the experts, and how one layer's dense weights sit in a slot.

A dense layer slot holds, 256-byte aligned: Wqkv fp16 [q_dim + 2 kv_dim, hidden] (the q, k
and v projections stacked, one GEMM), Wo fp16 [hidden, q_dim], and the float32 norm weights
attn_norm [hidden], q_norm and k_norm [head_dim]. fp16 rather than bf16: the same bytes, three
more mantissa bits, and the tensor-core path the experts already use; GGUF's F16, Q8_0 and the
K-quants dequantize to values of far smaller range than fp16's.

Fixed regions: the dense slots (every layer's when resident; a ring of DENSE_RING_SLOTS when
they stream), the head (output_norm, Wout fp16 [vocab, hidden]), the RoPE tables
[context, head_dim / 2] of cos and sin and the KV cache (fp16, n_layers x 2 x context x kv_dim).
Per chunk: the normed rows, q/k/v, q after RoPE, the attention output, the head's scratch (at
most LOGIT_ROWS rows per output GEMM) and the dense GEMM's workspace (cuBLAS's, or the fp32
scratch of the batch-invariant "own" GEMM, which grows with the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...backends.cuda.dense_kernels import workspace_bytes
from ...runtime.memory import align_up
from ...schedule.dense_schedule import DENSE_RING_SLOTS
from .spec import Qwen3Spec

#: rows of the output head one GEMM computes (all-position logits go in slices of this many)
LOGIT_ROWS = 64
_ALIGN = 256


@dataclass(frozen=True)
class WholeSizing:
    """What a whole model's device memory depends on besides the chunk: the model, the KV
    positions, whether the dense weights stream, and the dense GEMM ("cublas" or "own")."""

    spec: Qwen3Spec
    context: int
    dense_stream: bool = False
    gemm: str = "cublas"

    def streamed(self) -> WholeSizing:
        return WholeSizing(self.spec, self.context, True, self.gemm)


@dataclass(frozen=True)
class DenseSlot:
    """Byte offsets of one layer's dense weights inside its slot."""

    wqkv: int
    wo: int
    attn_norm: int
    q_norm: int
    k_norm: int
    nbytes: int

    @classmethod
    def of(cls, spec: Qwen3Spec) -> DenseSlot:
        H, hd = spec.hidden, spec.head_dim
        sizes = [("wqkv", (spec.q_dim + 2 * spec.kv_dim) * H * 2), ("wo", H * spec.q_dim * 2),
                 ("attn_norm", H * 4), ("q_norm", hd * 4), ("k_norm", hd * 4)]
        offsets, at = {}, 0
        for name, size in sizes:
            offsets[name] = at
            at = align_up(at + size, _ALIGN)
        return cls(nbytes=at, **offsets)


def kv_bytes(spec: Qwen3Spec, context: int) -> int:
    """fp16 keys and values of every layer for `context` positions."""
    return spec.n_layers * 2 * context * spec.kv_dim * 2


def whole_fixed_regions(w: WholeSizing) -> dict[str, int]:
    """Regions that depend on the model and the context, not on the chunk."""
    spec, context = w.spec, w.context
    slots = DENSE_RING_SLOTS if w.dense_stream else spec.n_layers
    return {
        "dense": slots * DenseSlot.of(spec).nbytes,
        "head_norm": spec.hidden * 4,
        "head": spec.vocab * spec.hidden * 2,
        "rope_cos": context * spec.head_dim // 2 * 4,
        "rope_sin": context * spec.head_dim // 2 * 4,
        "kv": kv_bytes(spec, context),
        "position": 16,  # the chunk's start, read by a decode step replayed as a graph
    }


def dense_workspace_bytes(w: WholeSizing, tokens: int) -> int:
    """The dense GEMM's workspace for chunks of up to `tokens` (the largest of its GEMMs)."""
    spec = w.spec
    return max(workspace_bytes(w.gemm, tokens, max(spec.q_dim + 2 * spec.kv_dim, spec.hidden)),
               workspace_bytes(w.gemm, LOGIT_ROWS, spec.vocab))


def whole_chunk_regions(w: WholeSizing, tokens: int) -> dict[str, int]:
    """Regions one chunk of `tokens` needs for attention and the head."""
    spec, T = w.spec, tokens
    return {
        "dense_ws": dense_workspace_bytes(w, T),
        "xa": T * spec.hidden * 2,
        "qkv": T * (spec.q_dim + 2 * spec.kv_dim) * 2,
        "q_rot": T * spec.q_dim * 2,
        "attn_out": T * spec.q_dim * 2,
        "head_in": LOGIT_ROWS * spec.hidden * 2,
        "head_out": LOGIT_ROWS * spec.vocab * 4,
    }
