"""Blocks of every GGML type for the decoder tests: random bytes with finite fp16 scales, the
package's own quantizer's output, and edge-case scales.

Random bytes are valid blocks for every decoded type; only the fp16 scale fields must be drawn
finite (an infinite or NaN scale makes NaN values, which the tests compare apart). This module
holds the one per-type fact the tests need beyond strata_rt.formats.ggml_types: where each type's
fp16 scales lie.
"""

from __future__ import annotations

import gguf
import numpy as np

from strata_rt.formats.ggml_types import TYPES, GgmlType
from strata_rt.gemm.ggml_decoders import DecoderSpec

#: byte offsets of the fp16 scale fields in a block (IQ1_M spreads its scale over the top
#: nibbles of four u16 words at 48..55: see finite_blocks); the float types and MXFP4 have none
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ1_S": (0,),
    "TQ2_0": (64,),  # the example plugin's type (tests/plugins/strata_testfmt)
}
#: fp16 bit patterns every scale field also takes: zeros of both signs, the smallest and the
#: largest subnormal, the smallest normal, one, the largest finite of both signs
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF],
                    dtype=np.uint16)


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns, none infinite or NaN (exponent 31 loses its top bit), the
    edge patterns first."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & np.uint16(0xBFFF), bits).astype(np.uint16)
    k = min(n, EDGE_F16.size)
    bits[:k] = EDGE_F16[:k]
    return bits


def _set_iq1m_scale(blocks: np.ndarray, f16: np.ndarray) -> None:
    """Writes fp16 patterns into IQ1_M's scale: bits 4k..4k+3 in the top nibble of word k."""
    for k in range(4):
        byte = 49 + 2 * k
        nib = ((f16 >> (4 * k)) & 0xF).astype(np.uint8)
        blocks[:, byte] = (blocks[:, byte] & 0x0F) | (nib << 4)


def random_blocks(rng: np.random.Generator, t: GgmlType | DecoderSpec, nblocks: int,
                  finite: bool = True) -> np.ndarray:
    """nblocks random blocks of t as uint8 [nblocks, block_bytes]; `finite`: every fp16 scale
    field finite (the first blocks take the edge patterns)."""
    blocks = rng.integers(0, 256, (nblocks, t.block_bytes), dtype=np.uint8)
    if not finite:
        return blocks
    if t.name == "IQ1_M":
        _set_iq1m_scale(blocks, finite_f16(rng, nblocks))
    for off in F16_FIELDS.get(t.name, ()):
        blocks[:, off:off + 2] = finite_f16(rng, nblocks).view(np.uint8).reshape(-1, 2)
    return blocks


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

    def scales() -> np.ndarray:
        return (rng.uniform(-1, 1, nblocks) / 8).astype("<f2").view("<u2")

    if t.name == "IQ1_M":
        _set_iq1m_scale(blocks, scales())
    if t.name == "MXFP4":  # e8m0 exponent: half scales 2^-6 .. 2^-1
        blocks[:, 0] = rng.integers(122, 128, nblocks, dtype=np.uint8)
    for off in F16_FIELDS.get(t.name, ()):
        blocks[:, off:off + 2] = scales().view(np.uint8).reshape(-1, 2)
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
    try:
        out = gguf.quants.quantize(weights, t.qtype)
    except NotImplementedError:
        return None
    return np.ascontiguousarray(out).view(np.uint8).reshape(weights.shape[0], -1)


#: the types gguf.quants.quantize handles (found by asking it, not listed)
QUANTIZABLE: tuple[GgmlType, ...] = tuple(
    t for t in TYPES
    if gguf_quantize(t, np.zeros((1, max(t.block_values, 8)), np.float32)) is not None)
