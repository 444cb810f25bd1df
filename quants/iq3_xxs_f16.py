"""IQ3_XXS through fp16 images: the format's default matmul (STRATA_MMQ_KERNEL=f16_gemm).

Why a format object of its own: the variant changes more than a kernel. The blob bytes stay
the GGUF's (same name, same blob layout, same quantize and dequantize), but the gathers
dequantize each expert into fp16 images in the group buffers (2 bytes per weight instead of
98 per 256), the activations are fp16 instead of q8_1, and the product is a grouped fp16 GEMM
with fp32 accumulation over the whole K (strata_rt.grouped_gemm), with no per-32-value
epilogue. Whoever runs it (the CUDA engine, the numpy reference backend, the conformance suite)
takes sizes, images, activations, kernels and reference from this one object, so they agree.

Numerics (not `exact`):
- images: each weight is fp16 (round to nearest even) of the float32 value IQ3XXS.dequantize
  gives, bit for bit on the device and in `images` (grouped_gemm.dequant_iq3_images);
- mmq_reference: float64 products of those fp16 images and the fp16 activations, rounded to
  float32 (grouped_gemm.gemm_reference); the kernel agrees with it within the conformance
  suite's KERNEL_NMSE (1e-6) and gives the same bytes on every run, tile and rows_hint;
- against a float64 product of the exact dequantized weights and the unquantized float32
  activations: NMSE <= FLOAT64_NMSE_BOUND = 1e-5 per product (the issue's contract), the bound
  tests/test_variants.py checks on the reference and the GPU tests on the kernel. What it
  measures is fp16 rounding of weights and activations (relative 2^-11 each), NMSE ~1e-7.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from strata_rt.activations import F16
from strata_rt.errors import FormatError
from strata_rt.formats import ExpertLayout, FormatKernels, QuantFormat
from strata_rt.grouped_gemm import (
    GroupedGemm,
    dequant_iq3_images,
    fp16_image_layout,
    gemm_reference,
)
from strata_rt.resources import KERNELS_ROOT

from .iq3_xxs import IQ3XXS
from .iq3_xxs_device import F16_GEMM

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

#: NMSE of a product against float64 on the exact weights and float32 activations (see above)
FLOAT64_NMSE_BOUND = 1e-5


class IQ3XXSDequantF16(IQ3XXS):
    """IQ3_XXS blobs multiplied as fp16 images on fp16 activations (see the module doc)."""

    activation = F16
    exact = False
    #: the element type the group-buffer images hold: the exact weights rounded to it (the
    #: conformance suite's image check reads this)
    image_dtype = np.float16
    description = ("IQ3_XXS, f16_gemm: dequantizing gather into fp16 images, grouped fp16 GEMM "
                   "with fp32 accumulation over the whole K, fp16 activations")

    def __init__(self) -> None:
        self.variant = F16_GEMM

    def layout(self, hidden: int, ffn: int) -> ExpertLayout:
        """The IQ3_XXS blob (same ranges and bytes) with fp16 images: 2 * rows * cols bytes."""
        return fp16_image_layout(super().layout(hidden, ffn))

    def images(self, blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
        """The fp16 images the dequantizing gather writes, as uint8 (its numpy twin)."""
        self.check_dims(hidden, ffn)
        return dequant_iq3_images(blob, hidden, ffn)

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        raw = np.ascontiguousarray(image, dtype=np.uint8).reshape(-1)
        if raw.size != 2 * rows * cols:
            raise FormatError(f"{self.name} ({self.variant}): an fp16 image of {rows} x {cols} "
                              f"takes {2 * rows * cols} bytes, got {raw.size}")
        return raw.view(np.float16).reshape(rows, cols).astype(np.float32)

    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """float64 products of the fp16 images and the fp16 activations (from
        prepare_activations), rounded to float32; rows outside the group are zero."""
        return gemm_reference(image, expert_ids, acts, bounds, m, k)

    def kernel_sources(self) -> list[Path]:
        """The dequantizing gather; the GEMM is kernels/common/gemm_f16.cu (shared)."""
        return [KERNELS_ROOT / self.kernel_dir / "dequant.cu"]

    def kernels_class(self) -> type[FormatKernels]:
        return IQ3XXSDequantF16Kernels


class IQ3XXSDequantF16Kernels(FormatKernels):
    """gather and gather_batch run the dequantizing gather (one launch for a whole batch, one
    per expert for gather); mmq runs the grouped fp16 GEMM. Unlike a byte copy it has no
    fallback: slots and group buffers are always aligned enough (2-byte sources, 16-byte
    images), and a misaligned address is refused with a FormatError naming it."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._gg = GroupedGemm(runtime)
        #: batches that fell back to per-expert launches (never: kept for NativeKernels' API)
        self.fallbacks = 0

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        self._gg.dequant_gather_iq3(stream, [src], pos, gu_buf, down_buf, self.layout)

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        self._gg.dequant_gather_iq3(stream, list(srcs), first_pos, gu_buf, down_buf,
                                    self.layout)

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        self._gg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)
