"""FP16 experts: gate, up and down as fp16 row-major matrices, multiplied on fp16 tensor cores.

The blob (gate rows, up rows, down rows) already is the two group-buffer images, so the gather
is a plain copy; the format still counts as not native (the project batches gathers only for
formats that declare it), so it copies one expert per launch. Its "MMQ" is a grouped fp16 GEMM
(mma.sync m16n8k16, fp32 accumulation) over fp16 activations. With no quantization error in the
weights beyond fp16 rounding, it is the accuracy reference for the quantized paths on the GPU.

Reference tolerance: the numpy reference is the float32 product of the fp16 values (numpy's
float32 matmul). Tensor cores sum in an order (and with internal precision) that is not IEEE
sequential, so the two agree within a tolerance, not bit for bit: the tests require
NMSE <= 1e-6 between kernel and reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats import KERNELS_ROOT, ExpertLayout, FormatKernels, QuantFormat
from strata_rt.hookspecs import hookimpl

from ._grouped import check_aligned, expert_rows, grid_rows, ids16

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

FP16_MAX = 65504.0
GGML_TYPE_F16 = 1
# MMQ tile geometry; must match kernels/fp16/mmq.cu
MMQ_TILE_M = 64
MMQ_TILE_N = 64
MMQ_THREADS = 128
GATHER_THREADS = 256
GATHER_MAX_BLOCKS = 1024


class FP16(QuantFormat):
    name = "fp16"
    ggml_type = GGML_TYPE_F16
    block_values = 1
    block_bytes = 2
    native = False
    activation = "f16"
    kernel_dir = "fp16"
    roundtrip_nmse = 1e-6
    dim_multiple = 128
    description = ("fp16 row-major experts, 16 bits/weight; fp16 tensor-core GEMM, "
                   "the GPU accuracy reference")

    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        if imatrix is not None:
            raise FormatError("fp16: conversion takes no importance matrix")
        w = self.check_weights(weights)
        big = np.abs(w) > FP16_MAX
        if big.any():
            r, c = np.argwhere(big)[0]
            raise FormatError(f"fp16: {int(big.sum())} weight(s) beyond fp16's range "
                              f"+-{FP16_MAX}, first {w[r, c]!r} at row {r}, column {c}")
        return w.astype(np.float16).view(np.uint8)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, self.row_bytes(cols))
        return b.view(np.float16).astype(np.float32)

    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """float32 product of the fp16 weights and fp16 activations (see the module doc for
        how closely the tensor-core kernel agrees)."""
        x = np.asarray(acts, dtype=np.float16)
        out = np.zeros((x.shape[0], m), dtype=np.float32)
        img = np.ascontiguousarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
        for p, r0, r1 in expert_rows(expert_ids, bounds):
            if r1 > r0:
                w = self.dequantize(img[p, : m * k * 2], (m, k))
                out[r0:r1] = x[r0:r1].astype(np.float32) @ w.T
        return out

    def kernels(self, runtime: Runtime, layout: ExpertLayout) -> FormatKernels:
        return FP16Kernels(self, runtime, layout)

    def kernels_class(self) -> type[FormatKernels]:
        return FP16Kernels


class FP16Kernels(FormatKernels):
    """Launchers of kernels/fp16: the per-expert plain copy and the grouped fp16 GEMM."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        src = KERNELS_ROOT / fmt.kernel_dir
        self._gather = runtime.module(src / "gather.cu").kernel("fp16_gather", "PPPqq")
        self._mmq = runtime.module(src / "mmq.cu").kernel("fp16_mmq", "P" + "i" * 16 + "PPPii")
        units = layout.gate_up_bytes // 16
        self._gather_blocks = min(-(-units // GATHER_THREADS), GATHER_MAX_BLOCKS)

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        lay = self.layout
        gu = gu_buf + pos * lay.gate_up_image_bytes
        dn = down_buf + pos * lay.down_image_bytes
        check_aligned({"src": src, "gate/up image": gu, "down image": dn})
        self._gather.launch(grid=(self._gather_blocks, 2, 1), block=(GATHER_THREADS, 1, 1),
                            stream=stream,
                            args=(src, gu, dn, lay.gate_up_bytes, lay.down_bytes))

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        ids = ids16(expert_ids)
        if m % MMQ_TILE_M or k % 64:
            raise FormatError(f"fp16 MMQ: m={m} must divide by {MMQ_TILE_M}, k={k} by 64")
        check_aligned({"weights": weights, "acts": acts, "out": out})
        ny = grid_rows(rows_hint, MMQ_TILE_N)
        if ny == 0:
            return
        self._mmq.launch(grid=(m // MMQ_TILE_M, ny, len(expert_ids)),
                         block=(MMQ_THREADS, 1, 1), stream=stream,
                         args=(weights, *ids, acts, bounds, out, m, k))


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [FP16()]
