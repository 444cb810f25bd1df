"""Q2 blob through fp16 images (STRATA_MMQ_KERNEL=f16_gemm): the format object of the variant,
its launchers and the numpy twin of its dequantizing gather (kernels/q2_blob/dequant.cu).

Why a variant: the exact int8 MMQ (the default) multiplies 2-bit codes by q8_1 activations and
pays a float epilogue per 32 values. Rebuilding each expert's images as fp16 weights instead
(one launch per expert, which the format already pays to de-interleave its planes) leaves the
grouped fp16 GEMM of strata_rt.grouped_gemm, which runs on sm_90's warpgroup tensor cores. The
blob stays the same bytes; the images are 2 bytes per weight instead of 2.25 bits, and the
activations are fp16.

Numerics (not `exact`): each image value is fp16((code - 1) * scale), bit for bit the same on
the device and in `images` (the product is exact and fits fp16); mmq_reference is the float64
product of those images and the fp16 activations (grouped_gemm.gemm_reference), which the
kernel meets within the conformance suite's tolerance, with the same bytes on every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata_rt.f16_images import F16ImagesVariant
from strata_rt.formats import ExpertLayout, FormatKernels, QuantFormat
from strata_rt.grouped_gemm import GroupedGemm
from strata_rt.resources import KERNELS_ROOT

from .q2_blob import Planes, Q2Blob, Q2Kernels, decode

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

F16_GEMM = "f16_gemm"


class Q2BlobDequantF16(F16ImagesVariant, Q2Blob):
    """Q2 blobs multiplied as fp16 images on fp16 activations (see the module doc)."""

    description = ("Q2 blob, f16_gemm: dequantizing gather into fp16 images, grouped fp16 GEMM "
                   "with fp32 accumulation over the whole K, fp16 activations")
    variant = F16_GEMM

    def images(self, blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
        """The fp16 images the dequantizing gather writes, as uint8 (its numpy twin)."""
        gc, dc, gs, ds = self._planes(blob, hidden, ffn)
        gu = decode(gc, gs)  # blob rows: gate 0, up 0, gate 1, ...
        with np.errstate(over="ignore"):
            gu16 = np.concatenate([gu[0::2], gu[1::2]]).astype(np.float16)
            dn16 = decode(dc, ds).astype(np.float16)
        return gu16.reshape(-1).view(np.uint8), dn16.reshape(-1).view(np.uint8)

    def kernel_sources(self) -> list[Path]:
        """The dequantizing gather and the exact MMQ source PerExpertKernels loads beside it;
        the GEMM is kernels/common/gemm_f16.cu (shared)."""
        return [KERNELS_ROOT / self.kernel_dir / n for n in ("dequant.cu", "mmq.cu")]

    def kernels_class(self) -> type[FormatKernels]:
        return Q2DequantF16Kernels


class Q2DequantF16Kernels(Q2Kernels):
    """The per-expert dequantizing gather and the shared grouped fp16 GEMM (the exact MMQ that
    Q2Kernels loads stays unused)."""

    gather_kernel = ("q2_dequant_f16", "ii")
    gather_source = "dequant.cu"
    gather_planes = 2

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._gg = GroupedGemm(runtime, iq3_gather=False)

    def gather_units(self) -> int:
        """16 bytes per thread of the grid-sizing rule = one 32-bit code word per thread."""
        return 4 * Planes.of(self.layout.hidden, self.layout.ffn).gu_codes_bytes

    def gather_args(self) -> tuple[int, ...]:
        return (self.layout.hidden, self.layout.ffn)

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        self._gg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)
