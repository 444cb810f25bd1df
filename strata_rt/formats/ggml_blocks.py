"""Random valid blocks of every GGML type: for the decoder tests (any finite scale, edge patterns
first) and for synthetic experts (scales chosen so a matrix's values have a given spread).

Random bytes are valid blocks for every decoded type once the fp16 scale fields are finite
(ggml_types.F16_SCALES says where they lie; IQ1_M spreads its scale over four nibbles); an
infinite or NaN scale makes NaN values. The float types are drawn as values instead, and MXFP4's
scale is an exponent byte, so a synthetic MXFP4 matrix picks that byte.
"""

from __future__ import annotations

from typing import Protocol

import gguf
import numpy as np

from .ggml_types import F16_SCALES, GgmlType


class BlockType(Protocol):
    """What the block helpers read of a type: a GgmlType, or a plugin decoder's spec."""

    @property
    def name(self) -> str: ...

    @property
    def block_values(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...


def _f16_fields(t: BlockType) -> tuple[int, ...]:
    """Byte offsets of t's fp16 scale fields (by its GGUF name: ggml_types.F16_SCALES)."""
    qtype = gguf.GGMLQuantizationType.__members__.get(t.name)
    return () if qtype is None else F16_SCALES.get(int(qtype.value), ())

#: fp16 bit patterns every scale field also takes: zeros of both signs, the smallest and the
#: largest subnormal, the smallest normal, one, the largest finite of both signs
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF],
                    dtype=np.uint16)
FLOAT_TYPES = ("F32", "F16", "BF16")
#: mean of the squared E2M1 magnitudes an MXFP4 value takes before its scale (gguf's table of
#: doubled values, halved by the scale's extra factor 1/2)
_MXFP4_MEAN_SQUARE = float(np.mean(np.square(gguf.quants.MXFP4.kvalues, dtype=np.float64)))


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random fp16 bit patterns, none infinite or NaN (exponent 31 loses its top bit), the
    edge patterns first."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & np.uint16(0xBFFF), bits).astype(np.uint16)
    k = min(n, EDGE_F16.size)
    bits[:k] = EDGE_F16[:k]
    return bits


def _iq1m_scale(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M's fp16 scale bits: bits 4k..4k+3 in the top nibble of u16 word k at 48..55."""
    out = np.zeros(blocks.shape[0], dtype=np.uint16)
    for k in range(4):
        out |= (blocks[:, 49 + 2 * k] >> 4).astype(np.uint16) << np.uint16(4 * k)
    return out


def _set_iq1m_scale(blocks: np.ndarray, f16: np.ndarray) -> None:
    for k in range(4):
        byte = 49 + 2 * k
        nib = ((f16 >> np.uint16(4 * k)) & 0xF).astype(np.uint8)
        blocks[:, byte] = (blocks[:, byte] & 0x0F) | (nib << 4)


def scale_fields(t: BlockType, blocks: np.ndarray) -> list[np.ndarray]:
    """Each fp16 scale field of every block, as uint16 bit patterns [nblocks]."""
    if t.name == "IQ1_M":
        return [_iq1m_scale(blocks)]
    return [blocks[:, off:off + 2].copy().view("<u2")[:, 0] for off in _f16_fields(t)]


def set_scale_fields(t: BlockType, blocks: np.ndarray, fields: list[np.ndarray]) -> None:
    """Writes fp16 bit patterns (one array per field, as scale_fields gives them) into blocks."""
    if t.name == "IQ1_M":
        _set_iq1m_scale(blocks, fields[0])
        return
    for off, bits in zip(_f16_fields(t), fields):
        blocks[:, off:off + 2] = np.asarray(bits, "<u2").view(np.uint8).reshape(-1, 2)


def random_blocks(rng: np.random.Generator, t: BlockType, nblocks: int,
                  finite: bool = True) -> np.ndarray:
    """nblocks random blocks of t as uint8 [nblocks, block_bytes]; `finite`: every fp16 scale
    field finite (the first blocks take the edge patterns)."""
    blocks = rng.integers(0, 256, (nblocks, t.block_bytes), dtype=np.uint8)
    if finite:
        set_scale_fields(t, blocks, [finite_f16(rng, nblocks) for _ in scale_fields(t, blocks)])
    return blocks


def float_bytes(t: GgmlType, w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] in a float type's encoding (round to nearest even), uint8 rows."""
    out = np.asarray(gguf.quants.quantize(np.ascontiguousarray(w, np.float32), t.qtype))
    return np.ascontiguousarray(out).view(np.uint8).reshape(w.shape[0], -1)


def random_matrix(rng: np.random.Generator, t: GgmlType, rows: int, cols: int,
                  std: float) -> np.ndarray:
    """A [rows, cols] matrix of valid random blocks whose values have about standard deviation
    `std`, as uint8 [rows, row_bytes(cols)]. Block types: random codes and fp16 scales drawn
    around 1 (x0.75..1.25), then every scale multiplied by one factor measured on the matrix
    (each value is linear in its block's fp16 scales); MXFP4: an exponent byte per block."""
    row = t.row_bytes(cols)
    if t.name in FLOAT_TYPES:
        return float_bytes(t, rng.standard_normal((rows, cols), dtype=np.float32) * std)
    n = rows * row // t.block_bytes
    blocks = rng.integers(0, 256, (n, t.block_bytes), dtype=np.uint8)
    if t.name == "MXFP4":  # value = 2^(e - 128) * kvalue; two exponents around the target
        e = 128 + np.log2(std / np.sqrt(_MXFP4_MEAN_SQUARE))
        blocks[:, 0] = np.clip(np.rint(e + rng.uniform(-0.5, 0.5, n)), 2, 254).astype(np.uint8)
        return blocks.reshape(rows, row)
    jitter = [rng.uniform(0.75, 1.25, n).astype(np.float16) for _ in scale_fields(t, blocks)]
    set_scale_fields(t, blocks, [j.view(np.uint16) for j in jitter])
    values = t.dequantize(blocks, t.block_values).astype(np.float64)
    rms = float(np.sqrt(np.mean(values * values)))
    factor = std / rms if rms > 0 else 1.0
    set_scale_fields(t, blocks, [(j.astype(np.float32) * np.float32(factor)).astype(np.float16)
                                 .view(np.uint16) for j in jitter])
    return blocks.reshape(rows, row)
