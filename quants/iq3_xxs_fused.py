"""IQ3_XXS through the GEMM that dequantizes in its main loop (STRATA_MMQ_KERNEL=f16_fused): the
variant's behaviour as a mixin, its launchers and its numpy twin. The format object,
IQ3XXSFusedF16, is this mixin over IQ3XXS and lives in quants/iq3_xxs.py beside the other
variant objects; this module imports nothing of IQ3XXS, so the dependency runs one way.

Why a variant of its own: f16_gemm pays a dequantizing gather that writes fp16 images of every
expert of a group whatever the prompt length; on short prompts that is most of a layer. Here
the gathers are the exact variants' byte copies (the group buffers hold the GGUF's blocks) and
the product decodes the blocks inside the GEMM (strata_rt.gemm.fused_gemm). Activations are fp16
as in f16_gemm.

Numerics (not `exact`): the same bytes as f16_gemm on the same blocks and activations. Each
weight the kernel multiplies is fp16 (round to nearest even) of the float32 value
IQ3XXS.dequantize gives (what `image_matrix` returns, `image_dtype` = float16), and the
accumulation is f16_gemm's; so mmq_reference is f16_gemm's reference (float64 products of the
fp16 weights and fp16 activations, rounded to float32) applied to the decoded blocks, and the
bound against float64 on the exact weights and float32 activations is f16_gemm's
FLOAT64_NMSE_BOUND.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats.activations import F16, Activation
from strata_rt.formats.contract import ExpertLayout, FormatKernels, QuantFormat, expert_rows
from strata_rt.formats.launchers import NativeKernels
from strata_rt.gemm.fused_gemm import F16_FUSED, FUSED_SOURCE, FusedGemm, native_image_bytes
from strata_rt.gemm.grouped_gemm import gemm_reference

from .iq3_xxs_f16 import FLOAT64_NMSE_BOUND, _iq3_range_to_f16

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

__all__ = ["F16_FUSED", "FLOAT64_NMSE_BOUND", "FusedF16Variant", "IQ3XXSFusedKernels",
           "fused_reference", "native_images_to_f16"]


def native_images_to_f16(images: np.ndarray, n: int, m: int, k: int) -> np.ndarray:
    """n native IQ3_XXS images (uint8 [n, >= native_image_bytes(m, k)]) -> float16 [n, m, k],
    each value as the kernel (and the dequantizing gather) decodes it."""
    nbytes = native_image_bytes(m, k)
    img = np.ascontiguousarray(images, dtype=np.uint8).reshape(n, -1)
    if img.shape[1] < nbytes:
        raise FormatError(f"images hold {img.shape[1]} bytes each; an IQ3_XXS image of {m} x "
                          f"{k} takes {nbytes}")
    out = np.empty((n, m, k), dtype=np.float16)
    for p in range(n):
        out[p] = _iq3_range_to_f16(img[p, :nbytes]).view(np.float16).reshape(m, k)
    return out


def fused_reference(images: np.ndarray, expert_ids: tuple[int, ...], acts_f16: np.ndarray,
                    bounds: np.ndarray, m: int, k: int) -> np.ndarray:
    """numpy twin of the fused kernel: f16_gemm's reference (grouped_gemm.gemm_reference) on
    the decoded native images; positions whose experts hold no rows are not decoded."""
    n = len(expert_ids)
    img = np.ascontiguousarray(images, dtype=np.uint8).reshape(n, -1)
    busy = {p for p, r0, r1 in expert_rows(expert_ids, bounds) if r1 > r0}
    dec = np.zeros((n, m, k), dtype=np.float16)
    for p in busy:
        dec[p] = native_images_to_f16(img[p: p + 1], 1, m, k)[0]
    return gemm_reference(dec, expert_ids, acts_f16, bounds, m, k)


class IQ3XXSFusedKernels(NativeKernels):
    """Byte-copy gathers (NativeKernels: the group buffers hold the blobs' blocks, batched
    launches included) and the fused GEMM as the MMQ."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._fg = FusedGemm(runtime)

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        self._fg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def mmq_in_place(self, stream, sources: list[int], expert_ids: tuple[int, ...], acts: int,
                     bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        self._fg.gemm_at(stream, sources, expert_ids, acts, bounds, out, m, k, rows_hint)


class FusedF16Variant:
    """What the f16_fused variant changes in an IQ3_XXS format object (mixed in before IQ3XXS):
    fp16 activations, not exact, images that are the native blocks (the blob layout and the
    byte-copy gathers stay IQ3XXS's) standing for their fp16-rounded weights, the fused kernel
    and f16_gemm's reference."""

    activation: ClassVar[Activation] = F16
    exact: ClassVar[bool] = False
    #: the type the kernel rounds each exact weight to before multiplying (the conformance
    #: suite's image check reads this)
    image_dtype = np.float16
    description: ClassVar[str] = (
        "IQ3_XXS, f16_fused: byte-copy gathers of the native blocks, GEMM dequantizing them in "
        "its main loop (fp16 weights, fp16 activations, fp32 accumulation over the whole K); "
        "same bytes as f16_gemm")
    #: the products are the same kernel whether the blocks were copied or not, so resident
    #: experts are always read in place (no byte-copy gather) whatever the chunk
    in_place_max_rows: ClassVar[int] = 1 << 30
    variant: str

    def __init__(self) -> None:
        self.variant = F16_FUSED

    def image_matrix(self, image: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """The weights the kernel multiplies for one native image: the exact values rounded to
        fp16, as float32."""
        return native_images_to_f16(image, 1, rows, cols)[0].astype(np.float32)

    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """float64 products of the decoded fp16 weights and the fp16 activations (from
        prepare_activations), rounded to float32; rows outside the group are zero."""
        return fused_reference(image, expert_ids, acts, bounds, m, k)

    def kernel_sources(self) -> list[Path]:
        """The fused GEMM; the byte-copy gathers are kernels/common/gather.cu (shared)."""
        return [FUSED_SOURCE]

    def kernels_class(self) -> type[FormatKernels]:
        return IQ3XXSFusedKernels
