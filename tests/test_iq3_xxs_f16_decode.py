"""The argument behind IQ3_XXS's fp16 decode (kernels/ggml/decode_iq.cuh, chunk8_h2), checked in
numpy against the gguf package: every float32 value gguf computes for an IQ3_XXS weight is
exact, so its fp16 rounding equals one correctly rounded fp16 product d * m, with m = grid *
(2 scale + 1) / 4 exact in fp16 and obtained as the exact fp16 product of the table's grid / 4
and the integer 2 scale + 1.
numpy's float16 product (float32 product of two fp16 values, exact, then one rounding) is that
product. Random d spans fp16 subnormals to values whose products overflow to infinity. The
matrix-vector kernels that use it are checked against the same reference on the GPU
(tests/test_ggml_gemv_gpu.py).
"""

from __future__ import annotations

import re

import gguf
import numpy as np

from strata_rt.resources import KERNELS_ROOT

BLOCKS = 1500


def _grid() -> np.ndarray:
    text = (KERNELS_ROOT / "ggml" / "tables.cuh").read_text()
    body = re.search(r"GGML_IQ3XXS_GRID\[256\] = \{(.*?)\};", text, re.S)
    assert body is not None
    return np.array([int(v[:-1], 16) for v in re.findall(r"0x[0-9a-f]+u", body.group(1))],
                    np.uint32)


def _f16_decode(d: np.ndarray, qs: np.ndarray, aux: np.ndarray) -> np.ndarray:
    """The kernel's steps, value by value, in fp16 where it works in fp16."""
    grid = _grid()
    out = np.empty((d.size, 256), np.float16)
    for i in range(0, 256, 8):
        a = aux[:, i >> 5]
        idx = (a >> np.uint32(7 * ((i >> 3) & 3))) & np.uint32(127)
        parity = np.array([bin(int(v)).count("1") & 1 for v in idx], np.uint32)
        pattern = idx | (parity << np.uint32(7))
        sc = ((2 * (a >> np.uint32(28)) + 1).astype(np.float32) * np.float32(0.25))
        sc64 = sc.astype(np.float16).astype(np.float64)
        assert np.array_equal(sc64, sc.astype(np.float64))  # (2 scale + 1) / 4 is exact
        for e in range(2):
            entry = grid[qs[:, (i >> 2) + e]]
            for v in range(4):
                byte = ((entry >> np.uint32(8 * v)) & np.uint32(255)).astype(np.float64)
                quarter = (byte / 4).astype(np.float16)  # the shared table's fp16 entry
                assert np.array_equal(quarter.astype(np.float64), byte / 4)
                odd = (2 * (a >> np.uint32(28)) + 1).astype(np.float16)  # 2 scale + 1
                # one fp16 product (numpy: exact float32 product, one rounding): exact too
                m = (quarter.astype(np.float32) * odd.astype(np.float32)).astype(np.float16)
                assert np.array_equal(m.astype(np.float64), byte * sc64)
                j = 4 * e + v
                negative = ((pattern >> np.uint32(j)) & np.uint32(1)).astype(bool)
                m = np.where(negative, -m, m)
                with np.errstate(over="ignore"):
                    out[:, i + j] = (m.astype(np.float32) * d.astype(np.float32)).astype(
                        np.float16)
    return out


def test_iq3_xxs_fp16_decode_equals_the_rounded_reference() -> None:
    rng = np.random.default_rng(7)
    d = (rng.standard_normal(BLOCKS) * np.exp2(rng.integers(-26, 10, BLOCKS))).astype(np.float16)
    qs = rng.integers(0, 256, (BLOCKS, 64), dtype=np.uint8)
    aux = rng.integers(0, 2 ** 32, (BLOCKS, 8), dtype=np.uint64).astype(np.uint32)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), qs,
                          aux.view(np.uint8).reshape(-1, 32)], axis=1)
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(raw.reshape(-1), gguf.GGMLQuantizationType.IQ3_XXS)
        want16 = np.asarray(want, np.float32).reshape(BLOCKS, 256).astype(np.float16)
    got = _f16_decode(d, qs, aux)
    tiny = np.abs(want16.astype(np.float32)) < np.float32(2.0 ** -14)
    assert tiny.any() and np.isinf(want16).any()  # subnormal and overflowing weights occur
    assert np.array_equal(got.view(np.uint16), want16.view(np.uint16))


def test_one_multiply_places_two_sign_bits() -> None:
    # chunk8_h2 puts sign bits j and j + 1 of the 8-bit pattern at bits 15 and 31 of word j / 2
    # with one multiply: the pattern's copies shifted by 15 - j and 30 - j never overlap
    pattern = np.arange(256, dtype=np.uint64)
    for j in (0, 2, 4, 6):
        shifted = ((pattern << np.uint64(15 - j)) | (pattern << np.uint64(30 - j))) & 0xFFFFFFFF
        product = (pattern * ((1 << (15 - j)) | (1 << (30 - j)))) & 0xFFFFFFFF
        assert np.array_equal(product, shifted)
        want = (((pattern >> np.uint64(j)) & 1) << 15) | (((pattern >> np.uint64(j + 1)) & 1) << 31)
        assert np.array_equal(product & 0x80008000, want)
