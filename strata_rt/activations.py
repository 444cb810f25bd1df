"""Activation encodings the matmul kernels consume, and their numpy twins (bit-exact).

q8_1 (for integer-weight formats): per 32 values d = amax/127 and q = round-half-away(x/d),
stored on the device as blocks of 128 values (16 bytes of four float32 scales, then 128 int8),
row-major: row r, block kb at byte (r*K/128 + kb)*144. f16: float16 [rows, K], round to
nearest even. kernels/common/activations.cu produces the same bytes on the GPU; the numpy
forms here are what the numpy matmul references take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import FormatError
from .formats import KERNELS_ROOT

if TYPE_CHECKING:
    from .runtime import Runtime

Q8_1_GROUP = 32
Q8_1_BLOCK = 128
Q8_1_BLOCK_BYTES = 144
KINDS = ("q8_1", "f16")


@dataclass
class Q8_1Acts:
    """q8_1 activations: q int8 [rows, K], d float32 [rows, K//32]."""

    q: np.ndarray
    d: np.ndarray

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def to_device_bytes(self) -> np.ndarray:
        """The device layout as uint8 [rows * K/128 * 144]."""
        rows, k = self.q.shape
        nb = k // Q8_1_BLOCK
        out = np.empty((rows, nb, Q8_1_BLOCK_BYTES), dtype=np.uint8)
        out[:, :, :16] = self.d.astype("<f4").reshape(rows, nb, 4).view(np.uint8).reshape(
            rows, nb, 16)
        out[:, :, 16:] = self.q.reshape(rows, nb, Q8_1_BLOCK).view(np.uint8)
        return out.reshape(-1)

    @classmethod
    def from_device_bytes(cls, raw: np.ndarray, rows: int, k: int) -> Q8_1Acts:
        nb = k // Q8_1_BLOCK
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, nb, Q8_1_BLOCK_BYTES)
        d = np.ascontiguousarray(b[:, :, :16]).view("<f4").reshape(rows, k // Q8_1_GROUP)
        q = np.ascontiguousarray(b[:, :, 16:]).view(np.int8).reshape(rows, k)
        return cls(q=q, d=d.astype(np.float32))


def _check_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise FormatError(f"activations must be 2-D [rows, K], got shape {x.shape}")
    if x.shape[1] % Q8_1_BLOCK:
        raise FormatError(
            f"activations have K={x.shape[1]} values per row; K must be a multiple of "
            f"{Q8_1_BLOCK}")
    return x.astype(np.float32, copy=False)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C's roundf on float32: exact (floor(|v| + 0.5) would round 0.49999997 up to 1)."""
    t = np.trunc(v)
    return t + np.where(np.abs(v - t) >= np.float32(0.5), np.sign(v), np.float32(0))


def quantize_q8_1(x: np.ndarray) -> Q8_1Acts:
    """numpy twin of quantize_q8_1_rows (identity index): same float32 operations, same bits."""
    x = _check_rows(x)
    rows, k = x.shape
    g = x.reshape(rows, k // Q8_1_GROUP, Q8_1_GROUP)
    amax = np.abs(g).max(axis=2) if rows else np.zeros((0, k // Q8_1_GROUP), np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (g / d[:, :, None]).astype(np.float32)
    q = np.where(amax[:, :, None] == 0, np.float32(0), round_half_away(v))
    return Q8_1Acts(q=q.astype(np.int8).reshape(rows, k), d=d)


def convert_f16(x: np.ndarray) -> np.ndarray:
    """numpy twin of convert_f16_rows: float16 [rows, K], round to nearest even."""
    with np.errstate(over="ignore"):  # beyond fp16 range is inf, as __float2half_rn gives
        return _check_rows(x).astype(np.float16)


def prepare(kind: str, x: np.ndarray) -> Q8_1Acts | np.ndarray:
    """The activations a format of activation encoding `kind` consumes, from float32 rows."""
    if kind == "q8_1":
        return quantize_q8_1(x)
    if kind == "f16":
        return convert_f16(x)
    raise FormatError(f"activation encoding {kind!r} is unknown; valid: {', '.join(KINDS)}")


def activation_bytes(kind: str, rows: int, k: int) -> int:
    """Device bytes of `rows` activation rows of K values in encoding `kind`."""
    if k % Q8_1_BLOCK:
        raise FormatError(f"K={k} must be a multiple of {Q8_1_BLOCK}")
    if kind == "q8_1":
        return rows * (k // Q8_1_BLOCK) * Q8_1_BLOCK_BYTES
    if kind == "f16":
        return rows * k * 2
    raise FormatError(f"activation encoding {kind!r} is unknown; valid: {', '.join(KINDS)}")


class ActivationKernels:
    """Launchers of kernels/common/activations.cu on one runtime."""

    SOURCE = KERNELS_ROOT / "common" / "activations.cu"

    def __init__(self, runtime: Runtime):
        mod = runtime.module(self.SOURCE)
        self._kernels = {
            "q8_1": mod.kernel("quantize_q8_1_rows", "PiPPii"),
            "f16": mod.kernel("convert_f16_rows", "PiPPii"),
        }

    def launch(self, kind: str, stream, x: int, x_stride: int, index: int, out: int,
               rows: int, k: int) -> None:
        """Encodes rows index[0..rows-1] of float32 x (row pitch x_stride floats; index=0
        means rows 0..rows-1) into `out`. x must be 16-byte aligned and x_stride % 4 == 0."""
        if kind not in self._kernels:
            raise FormatError(f"activation encoding {kind!r} is unknown; valid: {', '.join(KINDS)}")
        if k % Q8_1_BLOCK or x_stride % 4 or x % 16 or x_stride < k:
            raise FormatError(
                f"activation launch needs K % {Q8_1_BLOCK} == 0, x_stride % 4 == 0, "
                f"x_stride >= K and a 16-byte aligned x; got K={k}, x_stride={x_stride}, "
                f"x=0x{x:x}")
        if rows == 0:
            return
        per_y = 4 if kind == "q8_1" else 128
        grid_y = -(-(k // (Q8_1_BLOCK if kind == "q8_1" else 4)) // per_y)
        self._kernels[kind].launch(grid=(rows, grid_y, 1), block=(128, 1, 1), stream=stream,
                                   args=(x, x_stride, index, out, rows, k))
