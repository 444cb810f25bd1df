"""IQ3_XXS on the GPU: the exact MMQ launchers (kernels/iq3_xxs/mmq.cu, gathers from
NativeKernels), and the fp16 variants' launchers on IQ3_XXS's own kernels.

The arithmetic every exact variant shares is the contract `IQ3XXS.exact_mmq_reference` mirrors
bit for bit (its docstring states it). The fp16 variants are GGMLKernels (the choice of gather
and product per variant) with IQ3_XXS's kernels in each step: the dequantizing gather of
kernels/iq3_xxs/dequant.cu (one launch writes both images; the same bytes as the generic GGML
gather) and the GEMM decoding blocks in its main loop (kernels/iq3_xxs/fused.cu,
strata_rt.gemm.fused_gemm) for f16_fused and for in-place products.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from strata_rt.errors import FormatError
from strata_rt.formats.contract import ExpertLayout, QuantFormat
from strata_rt.formats.launchers import MMQ_ARG_TYPES, MmqTile, NativeKernels, launch_mmq
from strata_rt.gemm.fused_gemm import FusedGemm
from strata_rt.gemm.ggml_gather import GgmlGather
from strata_rt.gemm.ggml_kernels import GGMLKernels
from strata_rt.gemm.grouped_gemm import GroupedGemm
from strata_rt.resources import KERNELS_ROOT

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

#: exact MMQ kernels on q8_1 activations, fastest measured first, and the activation-row tile
#: sizes (TM in mmq.cu) each is compiled for. H200 (bench/notes.md, run 5): f16_pipe is the
#: fastest or tied from 2,048 tokens (37 / 85 / 119 TFLOPS per layer at 512 / 2,048 / 8,192
#: tokens); int8_occ2 (two blocks per SM) is faster at 512 tokens (41); f16 and int8 are the
#: unpipelined designs (int8: the llama.cpp-style integer reference path). All are
#: bit-identical to IQ3XXS.mmq_reference, so the choice among them changes speed only.
MMQ_TILES = {"f16_pipe": (32, 64, 128), "f16": (32, 64, 128), "int8": (32, 64, 128),
             "int8_occ2": (32, 64)}
MMQ_VARIANTS = tuple(MMQ_TILES)
MMQ_SOURCE = KERNELS_ROOT / "iq3_xxs" / "mmq.cu"
#: weight rows per block (TW in mmq.cu); m must be a multiple
MMQ_TILE_W = 128
MMQ_THREADS = 256
_A_STRIDE = 304
_SUB_BYTES = {"f16": 64, "int8": 32}  # by weight encoding (the variant's name up to "_")
_PAD = {"f16": 64, "int8": 32}


def mmq_smem_bytes(variant: str, tile_rows: int) -> int:
    """Dynamic shared memory of one MMQ block; mirrors Smem<> and PipeSmem<> in mmq.cu (which
    trap when launched with less)."""
    if variant == "f16_pipe":  # tables, 2 weight steps (256 B/row), 2 dq, 3 activation steps
        return 256 * 8 + 128 * 16 + 2 * MMQ_TILE_W * (256 + 4) + 3 * tile_rows * 144
    variant = variant.split("_")[0]
    w = MMQ_TILE_W * (8 * _SUB_BYTES[variant] + _PAD[variant])
    s21 = 8 * MMQ_TILE_W * 4 if variant == "int8" else 0
    return 256 * 4 + w + MMQ_TILE_W * 4 + s21 + 2 * tile_rows * _A_STRIDE


def tile_rows_for(variant: str, rows_hint: int) -> int:
    """The variant's smallest activation tile holding rows_hint rows (its largest beyond)."""
    tiles = MMQ_TILES[variant]
    for tm in tiles:
        if rows_hint <= tm:
            return tm
    return tiles[-1]


class IQ3XXSKernels(NativeKernels):
    """Gathers (from NativeKernels) plus the grouped MMQ of one exact variant: `variant`, else
    the format object's (IQ3XXS.variant), so the CUDA and reference backends opened on one
    format object agree without reading the environment again."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout,
                 variant: str | None = None):
        super().__init__(fmt, runtime, layout)
        chosen = variant or getattr(fmt, "variant", None) or MMQ_VARIANTS[0]
        if chosen not in MMQ_VARIANTS:
            raise FormatError(f"IQ3_XXS exact MMQ variant {chosen!r} is unknown; valid: "
                              f"{', '.join(MMQ_VARIANTS)} (the fp16 variants run "
                              "IQ3XXSF16Kernels)")
        self.variant = chosen
        mod = runtime.module(MMQ_SOURCE)
        self._mmq = {tm: mod.kernel(f"iq3_mmq_{self.variant}_m{tm}", MMQ_ARG_TYPES)
                     for tm in MMQ_TILES[self.variant]}
        self._tiles = {tm: MmqTile(m=MMQ_TILE_W, rows=tm, threads=MMQ_THREADS, k_multiple=256,
                                   shared=mmq_smem_bytes(self.variant, tm))
                       for tm in MMQ_TILES[self.variant]}

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        tm = tile_rows_for(self.variant, rows_hint)
        launch_mmq(self._mmq[tm], self._tiles[tm], "IQ3_XXS", stream, weights, expert_ids, acts,
                   bounds, out, m, k, rows_hint)


class IQ3XXSF16Kernels(GGMLKernels):
    """f16_gemm and f16_fused on IQ3_XXS's kernels: the dequantizing gather of dequant.cu (no
    fallback: slots and group buffers are always aligned enough, 2-byte sources and 16-byte
    images, and a misaligned address is refused with a FormatError naming it) and the fused
    GEMM of fused.cu."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        self._fg = FusedGemm(runtime)

    def open_gemm(self) -> GroupedGemm:
        return GroupedGemm(self.runtime)  # with the IQ3_XXS dequantizing gather

    def open_dequantizing_gather(self) -> GgmlGather | None:
        return None  # dequant.cu's, opened with the GEMM (GroupedGemm.dequant_gather_iq3)

    def dequantizing_gather(self, stream: Any, srcs: list[int], first_pos: int, gu_buf: int,
                            down_buf: int, bounds: int = 0, first_expert: int = 0) -> None:
        if self._gemm is None:
            raise FormatError(f"{self.fmt!r}: its gathers copy blocks; nothing dequantizes")
        self._gemm.dequant_gather_iq3(stream, srcs, first_pos, gu_buf, down_buf, self.layout,
                                      bounds, first_expert)

    def fused_gemm(self, stream: Any, weights: int, expert_ids: tuple[int, ...], acts: int,
                   bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        self._fg.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def fused_gemm_at(self, stream: Any, sources: list[int], expert_ids: tuple[int, ...],
                      acts: int, bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        self._fg.gemm_at(stream, sources, expert_ids, acts, bounds, out, m, k, rows_hint)

    def fused_gemm_table(self, stream: Any, table: int, offset: int, acts: int, bounds: int,
                         out: int, m: int, k: int, rows_hint: int, n_experts: int) -> None:
        self._fg.gemm_table(stream, table, offset, acts, bounds, out, m, k, rows_hint, n_experts)
