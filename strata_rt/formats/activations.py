"""Activation encodings the matmul kernels consume, as objects: one per encoding, each knowing
its device size, its numpy twin (bit-exact), the kernel of kernels/common/activations.cu that
writes it and the SwiGLU kernel of kernels/common/engine.cu that re-encodes the expert width.

A format names its encoding with `activation = Q8_1` or `F16` (the names "q8_1" and "f16" are
accepted where a format class is declared), so no caller compares strings.

q8_1 (for integer-weight formats): per 32 values d = amax/127 and q = round-half-away(x/d),
stored on the device as blocks of 128 values (16 bytes of four float32 scales, then 128 int8),
row-major: row r, block kb at byte (r*K/128 + kb)*144. f16: float16 [rows, K], round to
nearest even. Both need K % 128 == 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import FormatError
from ..resources import KERNELS_ROOT

if TYPE_CHECKING:
    from ..runtime import Runtime

Q8_1_GROUP = 32
Q8_1_BLOCK = 128
Q8_1_BLOCK_BYTES = 144
#: values one block row (grid.y) of either activation kernel encodes: 4 warps x 128 for q8_1,
#: 128 threads x 4 for f16
_VALUES_PER_GRID_Y = 512


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
    _check_k(x.shape[1])
    return x.astype(np.float32, copy=False)


def _check_k(k: int) -> None:
    if k % Q8_1_BLOCK:
        raise FormatError(f"activations have K={k} values per row; K must be a multiple of "
                          f"{Q8_1_BLOCK}")


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


class Activation:
    """One activation encoding. Instances are singletons (Q8_1, F16); compare with `is`."""

    #: short name, as configs and `strata plugins` show it
    name: str
    #: the kernel of kernels/common/activations.cu that writes this encoding
    kernel: str
    #: the kernel of kernels/common/engine.cu that applies SwiGLU and writes this encoding
    swiglu_kernel: str

    def nbytes(self, rows: int, cols: int) -> int:
        """Device bytes of `rows` rows of `cols` values (cols % 128 == 0)."""
        raise NotImplementedError

    def prepare(self, x: np.ndarray) -> Any:
        """numpy twin of the kernel: float32 [rows, K] -> what the formats' references take."""
        raise NotImplementedError

    def device_bytes(self, prepared: Any) -> np.ndarray:
        """What `prepare` gave, as the uint8 bytes the kernel writes on the device."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<activation {self.name}>"


class _Q8_1(Activation):
    name, kernel, swiglu_kernel = "q8_1", "quantize_q8_1_rows", "swiglu_q8_1"

    def nbytes(self, rows: int, cols: int) -> int:
        _check_k(cols)
        return rows * (cols // Q8_1_BLOCK) * Q8_1_BLOCK_BYTES

    def prepare(self, x: np.ndarray) -> Q8_1Acts:
        return quantize_q8_1(x)

    def device_bytes(self, prepared: Q8_1Acts) -> np.ndarray:
        return prepared.to_device_bytes()


class _F16(Activation):
    name, kernel, swiglu_kernel = "f16", "convert_f16_rows", "swiglu_f16"

    def nbytes(self, rows: int, cols: int) -> int:
        _check_k(cols)
        return rows * cols * 2

    def prepare(self, x: np.ndarray) -> np.ndarray:
        return convert_f16(x)

    def device_bytes(self, prepared: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(prepared, dtype=np.float16).view(np.uint8).reshape(-1)


Q8_1: Activation = _Q8_1()
F16: Activation = _F16()
#: every encoding, by name
ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (Q8_1, F16)}


def activation_named(kind: str | Activation) -> Activation:
    """The encoding called `kind` (an Activation is returned as it is)."""
    if isinstance(kind, Activation):
        return kind
    try:
        return ACTIVATIONS[kind]
    except (KeyError, TypeError):
        raise FormatError(f"activation encoding {kind!r} is unknown; valid: "
                          f"{', '.join(ACTIVATIONS)}") from None


class ActivationKernels:
    """Launchers of kernels/common/activations.cu on one runtime."""

    SOURCE = KERNELS_ROOT / "common" / "activations.cu"

    def __init__(self, runtime: Runtime):
        mod = runtime.module(self.SOURCE)
        self._kernels = {a.name: mod.kernel(a.kernel, "PiPPii") for a in ACTIVATIONS.values()}
        self._gather_f16 = mod.kernel("gather_f16_rows", "PiPPii")

    def launch(self, activation: Activation | str, stream, x: int, x_stride: int, index: int,
               out: int, rows: int, k: int) -> None:
        """Encodes rows index[0..rows-1] of float32 x (row pitch x_stride floats; index=0
        means rows 0..rows-1) into `out`. x must be 16-byte aligned and x_stride % 4 == 0."""
        act = activation_named(activation)
        if k % Q8_1_BLOCK or x_stride % 4 or x % 16 or x_stride < k:
            raise FormatError(
                f"activation launch needs K % {Q8_1_BLOCK} == 0, x_stride % 4 == 0, "
                f"x_stride >= K and a 16-byte aligned x; got K={k}, x_stride={x_stride}, "
                f"x=0x{x:x}")
        if rows == 0:
            return
        grid_y = -(-k // _VALUES_PER_GRID_Y)
        self._kernels[act.name].launch(grid=(rows, grid_y, 1), block=(128, 1, 1), stream=stream,
                                       args=(x, x_stride, index, out, rows, k))

    def gather_f16(self, stream, x: int, x_stride: int, index: int, out: int, rows: int,
                   k: int) -> None:
        """Copies rows index[0..rows-1] of fp16 x (row pitch x_stride halves) into `out`: the
        F16 encoding of rows whose fp16 values exist already (the exact routing's split
        RMSNorm writes them). x must be 16-byte aligned and x_stride % 8 == 0."""
        if k % Q8_1_BLOCK or x_stride % 8 or x % 16 or x_stride < k:
            raise FormatError(
                f"fp16 row gather needs K % {Q8_1_BLOCK} == 0, x_stride % 8 == 0, x_stride >= "
                f"K and a 16-byte aligned x; got K={k}, x_stride={x_stride}, x=0x{x:x}")
        if rows == 0:
            return
        self._gather_f16.launch(grid=(rows, -(-k // (2 * _VALUES_PER_GRID_Y)), 1),
                                block=(128, 1, 1), stream=stream,
                                args=(x, x_stride, index, out, rows, k))
