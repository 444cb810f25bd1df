"""Blocks of every GGML type for the decoder tests: random bytes with finite fp16 scales (the
library's strata_rt.formats.ggml_blocks, which knows where each type's scales lie), blocks of
moderate values, the package's own quantizer's output, and edge-case scales."""

from __future__ import annotations

import numpy as np

from strata_rt.formats.ggml_blocks import random_blocks, scale_fields, set_scale_fields
from strata_rt.formats.ggml_format import gguf_quantizes
from strata_rt.formats.ggml_types import TYPES, GgmlType
from strata_rt.gemm.ggml_decoders import DecoderSpec

__all__ = ["QUANTIZABLE", "gguf_quantize", "moderate_blocks", "quantize_source",
           "random_blocks", "row_ids", "row_matrix"]


def moderate_blocks(rng: np.random.Generator, t: GgmlType | DecoderSpec,
                    nblocks: int) -> np.ndarray:
    """nblocks random blocks of t whose values are all finite and of moderate size (scales of
    magnitude below 1/8, float types standard normal), so products of them stay finite and a
    kernel can be compared with a float64 reference within a tolerance."""
    if t.block_values == 1:
        vals = rng.standard_normal(nblocks)
        if t.name == "F32":
            return vals.astype("<f4").view(np.uint8).reshape(nblocks, 4)
        if t.name == "BF16":
            return (vals.astype("<f4").view("<u4") >> 16).astype("<u2").view(np.uint8).reshape(
                nblocks, 2)
        return vals.astype("<f2").view(np.uint8).reshape(nblocks, 2)
    blocks = rng.integers(0, 256, (nblocks, t.block_bytes), dtype=np.uint8)
    if t.name == "MXFP4":  # e8m0 exponent: half scales 2^-6 .. 2^-1
        blocks[:, 0] = rng.integers(122, 128, nblocks, dtype=np.uint8)
    set_scale_fields(t, blocks, [(rng.uniform(-1, 1, nblocks) / 8).astype("<f2").view("<u2")
                                 for _ in scale_fields(t, blocks)])
    return blocks


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


def row_matrix(rng: np.random.Generator, t: GgmlType, vocab: int, cols: int) -> np.ndarray:
    """A [vocab, cols] matrix of t as raw rows (uint8 [vocab, row bytes]), as an embedding
    would be stored: the gguf package's quantizer output where it has one (of values at
    scales 1e-3 .. 1e3 per row), else random valid blocks (finite scales)."""
    if t in QUANTIZABLE:
        w = rng.standard_normal((vocab, cols)).astype(np.float32)
        w *= (10.0 ** rng.uniform(-3, 3, (vocab, 1))).astype(np.float32)
        raw = gguf_quantize(t, w)
        assert raw is not None
        return raw
    return random_blocks(rng, t, vocab * cols // t.block_values).reshape(vocab, -1)


def row_ids(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    """n int32 row ids (n >= 5) with repeats, the first and the last row among them."""
    ids = rng.integers(0, vocab, n).astype(np.int32)
    ids[:4] = [0, vocab - 1, ids[4], ids[4]]
    return ids
