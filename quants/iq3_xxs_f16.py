"""IQ3_XXS through fp16 images, the format's default matmul (STRATA_MMQ_KERNEL=f16_gemm): the
dequantizing gather's numpy twin and the launchers. The format object of the variant,
IQ3XXSDequantF16, lives in quants/iq3_xxs.py beside IQ3XXS (which returns it from for_variant);
this module imports nothing of IQ3XXS, so the dependency runs one way.

Why a format object of its own: the variant changes more than a kernel. The blob bytes stay
the GGUF's (same name, same blob layout, same quantize and dequantize), but the gathers
dequantize each expert into fp16 images in the group buffers (2 bytes per weight instead of
98 per 256), the activations are fp16 instead of q8_1, and the product is a grouped fp16 GEMM
with fp32 accumulation over the whole K (strata_rt.gemm.grouped_gemm), with no per-32-value
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

from typing import TYPE_CHECKING

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats.contract import ExpertLayout, FormatKernels, QuantFormat
from strata_rt.gemm.fused_gemm import FusedGemm
from strata_rt.gemm.grouped_gemm import GroupedGemm

from .iq3_xxs_grid import GRID

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

#: NMSE of a product against float64 on the exact weights and float32 activations (see above)
FLOAT64_NMSE_BOUND = 1e-5
IQ3_BLOCK_VALUES = 256
IQ3_BLOCK_BYTES = 98


def _iq3_range_to_f16(raw: np.ndarray) -> np.ndarray:
    """98-byte IQ3_XXS blocks -> their 256 values each as fp16 bits (uint16), computed the way
    dequant.cu does: per lane of 8 values, sign applied to the rounded fp16 value."""
    blk = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, IQ3_BLOCK_BYTES)
    nb = blk.shape[0]
    d = blk[:, :2].copy().view("<f2")[:, 0].astype(np.float32)                  # [nb]
    words = blk[:, 66:].copy().view("<u4").astype(np.uint32)                    # [nb, 8]
    db = (d[:, None] * (np.float32(0.5) + (words >> 28).astype(np.float32))) * np.float32(0.5)
    sidx = (words[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127     # [nb, 8, 4]
    parity = np.unpackbits(sidx.astype(np.uint8)[..., None], axis=-1).sum(-1) & 1
    neg_mask = sidx | (parity.astype(np.uint32) << 7)
    neg = (neg_mask[..., None] >> np.arange(8, dtype=np.uint32)) & 1            # [nb, 8, 4, 8]
    grid = np.array(GRID, dtype=np.uint32)[blk[:, 2:66]]                         # [nb, 64]
    mag = (grid[..., None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF       # [nb, 64, 4]
    vals = db.repeat(32, axis=1) * mag.reshape(nb, 256).astype(np.float32)
    with np.errstate(over="ignore"):
        bits = vals.astype(np.float16).view(np.uint16)
    return bits ^ (neg.reshape(nb, 256).astype(np.uint16) << 15)


def dequant_iq3_images(blob: np.ndarray, hidden: int, ffn: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of the dequantizing gather: an IQ3_XXS expert blob -> (gate/up image, down
    image) as uint8, the exact bytes of fp16 [2*ffn, hidden] and fp16 [hidden, ffn]."""
    gu_bytes = 2 * ffn * hidden // IQ3_BLOCK_VALUES * IQ3_BLOCK_BYTES  # gate rows, up rows
    dn_bytes = hidden * ffn // IQ3_BLOCK_VALUES * IQ3_BLOCK_BYTES      # then down rows
    b = np.asarray(blob, dtype=np.uint8).reshape(-1)
    if hidden % IQ3_BLOCK_VALUES or ffn % IQ3_BLOCK_VALUES or b.size < gu_bytes + dn_bytes:
        raise FormatError(f"IQ3_XXS blob of {b.size} bytes; hidden {hidden}, ffn {ffn} take "
                          f"{gu_bytes + dn_bytes} (dimensions multiples of {IQ3_BLOCK_VALUES})")
    gu = _iq3_range_to_f16(b[:gu_bytes])
    dn = _iq3_range_to_f16(b[gu_bytes: gu_bytes + dn_bytes])
    return gu.reshape(-1).view(np.uint8), dn.reshape(-1).view(np.uint8)


class IQ3XXSDequantF16Kernels(FormatKernels):
    """gather and gather_batch run the dequantizing gather (one launch for a whole batch, one
    per expert for gather); mmq runs the grouped fp16 GEMM. Unlike a byte copy it has no
    fallback: slots and group buffers are always aligned enough (2-byte sources, 16-byte
    images), and a misaligned address is refused with a FormatError naming it."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._gg = GroupedGemm(runtime)
        #: the GEMM that decodes native blocks in its main loop: products of experts read in
        #: place from their resident slots (short chunks), the same bytes as gather + mmq
        self._fg = FusedGemm(runtime)
        #: batches that fell back to per-expert launches (never: kept for NativeKernels' API)
        self.fallbacks = 0

    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        self._gg.dequant_gather_iq3(stream, [src], pos, gu_buf, down_buf, self.layout)

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        self._gg.dequant_gather_iq3(stream, list(srcs), first_pos, gu_buf, down_buf,
                                    self.layout)

    def gather_routed(self, stream, srcs: list[int], gu_buf: int, down_buf: int, bounds: int,
                      first_expert: int) -> None:
        self._gg.dequant_gather_iq3(stream, list(srcs), 0, gu_buf, down_buf, self.layout,
                                    bounds, first_expert)

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        self._gg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def mmq_in_place(self, stream, sources: list[int], expert_ids: tuple[int, ...], acts: int,
                     bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        self._fg.gemm_at(stream, sources, expert_ids, acts, bounds, out, m, k, rows_hint)
