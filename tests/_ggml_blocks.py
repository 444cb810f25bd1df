"""Blocks of every GGML type for the decoder tests: random bytes with finite fp16 scales (the
library's strata_rt.formats.ggml_blocks, which knows where each type's scales lie), the
package's own quantizer's output, and edge-case scales."""

from __future__ import annotations

import numpy as np

from strata_rt.formats.ggml_blocks import random_blocks
from strata_rt.formats.ggml_format import gguf_quantizes
from strata_rt.formats.ggml_types import TYPES, GgmlType

__all__ = ["QUANTIZABLE", "gguf_quantize", "quantize_source", "random_blocks"]


def quantize_source(rng: np.random.Generator, nblocks: int, block_values: int) -> np.ndarray:
    """float32 weights, block by block at scales from 1e-6 to 1e4, one all-zero block and one
    block of a single value: what a quantizer sees in a real tensor and its edge cases."""
    w = rng.standard_normal((nblocks, block_values)).astype(np.float32)
    w *= (10.0 ** rng.uniform(-6, 4, (nblocks, 1))).astype(np.float32)
    w[0] = 0
    if nblocks > 1:
        w[1] = w[1, 0]
    return w


def gguf_quantize(t: GgmlType, weights: np.ndarray) -> np.ndarray | None:
    """gguf.quants.quantize of float32 [rows, cols] to t as uint8 rows, or None when the package
    cannot quantize t (it dequantizes every type but quantizes only some)."""
    import gguf

    if not gguf_quantizes(t):
        return None
    out = gguf.quants.quantize(weights, t.qtype)
    return np.ascontiguousarray(out).view(np.uint8).reshape(weights.shape[0], -1)


#: the types gguf.quants.quantize handles (found by asking it, not listed)
QUANTIZABLE: tuple[GgmlType, ...] = tuple(t for t in TYPES if gguf_quantizes(t))
