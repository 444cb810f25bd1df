"""IQ3_XXS on the GPU: the exact MMQ launchers (kernels/iq3_xxs/mmq.cu); gathers come from
NativeKernels. The arithmetic every exact variant shares is the contract
`IQ3XXS.mmq_reference` mirrors bit for bit (its docstring states it). The default variant,
f16_gemm, is a format object of its own (quants/iq3_xxs_f16.py): it changes the images and
the activations, not only the kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata_rt.errors import FormatError
from strata_rt.formats.contract import ExpertLayout, QuantFormat
from strata_rt.formats.launchers import MMQ_ARG_TYPES, MmqTile, NativeKernels, launch_mmq
from strata_rt.resources import KERNELS_ROOT

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

#: the two-phase variant (dequantizing gather into fp16 images, grouped fp16 GEMM with fp32
#: accumulation over the whole K): the default, not bit-identical to the exact kernels
F16_GEMM = "f16_gemm"
#: exact MMQ kernels on q8_1 activations, fastest measured first, and the activation-row tile
#: sizes (TM in mmq.cu) each is compiled for. H200 (bench/notes.md, run 5): f16_pipe is the
#: fastest or tied from 2,048 tokens (37 / 85 / 119 TFLOPS per layer at 512 / 2,048 / 8,192
#: tokens); int8_occ2 (two blocks per SM) is faster at 512 tokens (41); f16 and int8 are the
#: unpipelined designs (int8: the llama.cpp-style integer reference path). All are
#: bit-identical to IQ3XXS.mmq_reference, so the choice among them changes speed only.
MMQ_TILES = {"f16_pipe": (32, 64, 128), "f16": (32, 64, 128), "int8": (32, 64, 128),
             "int8_occ2": (32, 64)}
MMQ_VARIANTS = tuple(MMQ_TILES)
#: every name STRATA_MMQ_KERNEL accepts for IQ3_XXS (IQ3XXS.mmq_variants()), the default first
VARIANTS = (F16_GEMM, *MMQ_VARIANTS)
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
                              f"{', '.join(MMQ_VARIANTS)} ({F16_GEMM} is a format object of "
                              "its own: IQ3XXS().for_variant)")
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
