"""FP16 experts: gate, up and down as fp16 row-major matrices, multiplied on fp16 tensor cores.

The blob (gate rows, up rows, down rows) already is the two group-buffer images, so the gather
is a plain copy; the format still counts as not native (the project batches gathers only for
formats that declare it), so it copies one expert per launch. Its "MMQ" is a grouped fp16 GEMM
(fp32 accumulation) over fp16 activations, one of two variants (STRATA_MMQ_KERNEL):
- gemm (default): strata_rt.gemm.grouped_gemm, the shared kernel of kernels/common/gemm_f16.cu
  (cp.async pipeline, ldmatrix, mma.sync m16n8k16, 32/64/128-row tiles by rows_hint);
- tile64: kernels/fp16/mmq.cu, the first fp16 kernel (64 x 64 tiles, no pipeline).
Both read the same images and activations, so one format object serves both; `variant` picks
the launcher. With no quantization error in the weights beyond fp16 rounding, it is the
accuracy reference for the quantized paths on the GPU.

Reference tolerance: the numpy reference is the float32 product of the fp16 values (numpy's
float32 matmul). Tensor cores sum in an order (and with internal precision) that is not IEEE
sequential, so either kernel agrees with it within a tolerance, not bit for bit: the
conformance suite requires NMSE <= 1e-6 (KERNEL_NMSE) between kernel and reference.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16
from strata_rt.formats.contract import FormatKernels, QuantFormat, expert_rows
from strata_rt.formats.hookspecs import hookimpl
from strata_rt.formats.launchers import MmqTile, PerExpertKernels
from strata_rt.gemm.grouped_gemm import GroupedGemmProducts

FP16_MAX = 65504.0
GGML_TYPE_F16 = 1
#: STRATA_MMQ_KERNEL names for fp16, the default first
VARIANTS = ("gemm", "tile64")


class FP16(QuantFormat):
    name = "fp16"
    ggml_type = GGML_TYPE_F16
    block_values = 1
    block_bytes = 2
    native = False
    activation = F16
    exact = False
    kernel_dir = "fp16"
    roundtrip_nmse = 1e-6
    dim_multiple = 128
    description = ("fp16 row-major experts, 16 bits/weight; grouped fp16 tensor-core GEMM "
                   "(gemm: the shared pipelined kernel, default; tile64: the first one), the "
                   "GPU accuracy reference")

    def __init__(self, variant: str | None = None):
        chosen = variant or VARIANTS[0]
        if chosen not in VARIANTS:
            raise FormatError(f"fp16: MMQ variant {chosen!r} is unknown; valid: "
                              f"{', '.join(VARIANTS)}")
        self.variant = chosen

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
        how closely the tensor-core kernel agrees). einsum, not BLAS: each output's summation
        order is then fixed, so a row's result does not depend on how many rows came with it
        (the reference engine's chunking guarantee)."""
        x = np.asarray(acts, dtype=np.float16)
        out = np.zeros((x.shape[0], m), dtype=np.float32)
        img = np.ascontiguousarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
        for p, r0, r1 in expert_rows(expert_ids, bounds):
            if r1 > r0:
                w = self.dequantize(img[p, : m * k * 2], (m, k))
                out[r0:r1] = np.einsum("tk,mk->tm", x[r0:r1].astype(np.float32), w)
        return out

    def kernels_class(self) -> type[FormatKernels]:
        return FP16GemmKernels if self.variant == "gemm" else FP16Kernels

    def mmq_variants(self) -> tuple[str, ...]:
        return VARIANTS

    def for_variant(self, name: str | None) -> QuantFormat:
        """An FP16 whose launchers run variant `name` (None: gemm); same images, activations
        and reference."""
        super().for_variant(name)
        chosen = name or VARIANTS[0]
        return self if chosen == self.variant else FP16(chosen)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.variant})>"


class FP16Kernels(PerExpertKernels):
    """Launchers of kernels/fp16 (variant tile64): the per-expert plain copy and the grouped
    fp16 GEMM of kernels/fp16/mmq.cu."""

    gather_kernel = ("fp16_gather", "qq")
    gather_planes = 2
    mmq_kernel: ClassVar[str | None] = "fp16_mmq"
    #: TILE_M, TILE_N, NTHREADS and KSTEP of kernels/fp16/mmq.cu
    mmq_tile = MmqTile(m=64, rows=64, threads=128, k_multiple=64)

    def gather_units(self) -> int:
        return self.layout.gate_up_bytes

    def gather_args(self) -> tuple[int, ...]:
        return (self.layout.gate_up_bytes, self.layout.down_bytes)


class FP16GemmKernels(GroupedGemmProducts, FP16Kernels):
    """Variant gemm: FP16Kernels' per-expert copy, and the MMQ on the shared grouped fp16 GEMM
    (strata_rt.gemm.grouped_gemm), whose fp16 image layout the blob already is."""


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [FP16()]
