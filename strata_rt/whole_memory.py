"""Device memory of a whole model's dense part, as pure Python: what memory_plan adds to the
CUDA backend's arena beside the experts, and how one layer's dense weights sit in a slot.

A dense layer slot holds, 256-byte aligned: Wqkv fp16 [q_dim + 2 kv_dim, hidden] (the q, k
and v projections stacked, one GEMM), Wo fp16 [hidden, q_dim], and the float32 norm weights
attn_norm [hidden], q_norm and k_norm [head_dim]. fp16 rather than bf16: the same bytes, three
more mantissa bits, and the tensor-core path the experts already use; GGUF's F16, Q8_0 and the
K-quants dequantize to values of far smaller range than fp16's.

Fixed regions: every layer's slot, the head (output_norm, Wout fp16 [vocab, hidden]), the RoPE
tables [context, head_dim / 2] of cos and sin, the KV cache (fp16, n_layers x 2 x context x
kv_dim) and the cuBLAS workspace. Per chunk: the normed rows, q/k/v, q after RoPE, the attention
output, and the head's scratch (at most LOGIT_ROWS rows per output GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

from .qwen3.spec import Qwen3Spec
from .runtime.memory import align_up

#: rows of the output head one GEMM computes (all-position logits go in slices of this many)
LOGIT_ROWS = 64
#: cuBLAS workspace (set once, so graph capture never allocates)
CUBLAS_WORKSPACE = 32 << 20
_ALIGN = 256


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


def whole_fixed_regions(spec: Qwen3Spec, context: int) -> dict[str, int]:
    """Regions that depend on the model and the context, not on the chunk."""
    return {
        "dense": spec.n_layers * DenseSlot.of(spec).nbytes,
        "head_norm": spec.hidden * 4,
        "head": spec.vocab * spec.hidden * 2,
        "rope_cos": context * spec.head_dim // 2 * 4,
        "rope_sin": context * spec.head_dim // 2 * 4,
        "kv": kv_bytes(spec, context),
        "cublas_ws": CUBLAS_WORKSPACE,
    }


def whole_chunk_regions(spec: Qwen3Spec, tokens: int) -> dict[str, int]:
    """Regions one chunk of `tokens` needs for attention and the head."""
    T = tokens
    return {
        "xa": T * spec.hidden * 2,
        "qkv": T * (spec.q_dim + 2 * spec.kv_dim) * 2,
        "q_rot": T * spec.q_dim * 2,
        "attn_out": T * spec.q_dim * 2,
        "head_in": LOGIT_ROWS * spec.hidden * 2,
        "head_out": LOGIT_ROWS * spec.vocab * 4,
    }
