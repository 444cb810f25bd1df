"""Launchers of a GGML format's fp16 variants (strata_rt.formats.ggml_format): gathers and
products of f16_gemm and f16_fused on one runtime.

- gathers: where the group buffers hold the native blocks (f16_fused, and F16 whose blocks are
  fp16 images), the byte copies every native format shares (NativeKernels, batched and routed
  included); otherwise the batched dequantizing gather of every GGML type (GgmlGather), one
  launch for the 2*ffn gate/up rows and one for the down rows;
- products: f16_gemm multiplies fp16 images with the grouped fp16 GEMM (GroupedGemm.gemm);
  f16_fused, and f16_gemm's in-place products, run the GEMM that decodes blocks in its main
  loop (strata_rt.gemm.ggml_fused, imported on first use, so the other paths never need it);
- a decode step's routed experts (gemv_routed): the matrix-vector kernels of
  strata_rt.gemm.ggml_gemv, gate/up of the format's type, down of its down type.

A format with kernels of its own for these steps (IQ3_XXS) subclasses this and overrides
open_gemm, dequantizing_gather, fused_gemm, fused_gemm_at and fused_gemm_table; the choice of
step stays here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import FormatError
from ..formats.contract import ExpertLayout, FormatKernels, QuantFormat
from ..formats.ggml_variants import F16_GEMM, F16_VARIANTS
from ..formats.launchers import NativeKernels, check_aligned
from .ggml_decoders import DecoderSpec, GgmlKey
from .ggml_fused import GgmlFused
from .ggml_gather import GgmlGather
from .ggml_gemv import GgmlGemv
from .grouped_gemm import GroupedGemm

if TYPE_CHECKING:
    from pathlib import Path

    from ..formats.ggml_types import GgmlType
    from ..runtime import Runtime


class GGMLKernels(FormatKernels):
    """gather / gather_batch / gather_routed, mmq and mmq_in_place of a GGML format's fp16
    variant (see the module doc). The format object says which: `variant` and
    `images_are_blocks`."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout):
        super().__init__(fmt, runtime, layout)
        # a GGMLFormat, read by its attributes: that module names this class as its launchers,
        # so importing it here would make a circle
        g: Any = fmt
        if not hasattr(g, "gtype") or getattr(g, "variant", None) not in F16_VARIANTS:
            raise FormatError(f"{fmt!r}: GGMLKernels runs the fp16 variants of a GGMLFormat "
                              f"({', '.join(F16_VARIANTS)})")
        self.variant: str = g.variant
        self.gtype: GgmlType = g.gtype
        self.decoder_source: Path | None = g.decoder_source
        #: what the GGML launchers take for the type: the table entry of a built-in type, the
        #: decoder spec of a plugin's (the name of its STRATA_GGML_KERNELS line)
        self._own: list[DecoderSpec] = [] if self.decoder_source is None else [DecoderSpec(
            self.gtype.name, self.gtype.block_values, self.gtype.block_bytes)]
        self.decoder: GgmlKey = self._own[0] if self._own else self.gtype
        #: the down rows' decoder: the same, or the built-in type of a down_typed layer's
        self.down_decoder: GgmlKey = (self.decoder if g.down_gtype is g.gtype
                                      else g.down_gtype)
        self._copy = NativeKernels(fmt, runtime, layout) if g.images_are_blocks else None
        self._dequant = None if self._copy is not None else self.open_dequantizing_gather()
        self._gemm = self.open_gemm() if self.variant == F16_GEMM else None
        self._fused: GgmlFused | None = None
        self._gemv: GgmlGemv | None = None

    # ------------------------------------------------------------------ what a subclass swaps
    def open_gemm(self) -> GroupedGemm:
        """The grouped fp16 GEMM of f16_gemm."""
        return GroupedGemm(self.runtime, iq3_gather=False)

    def open_dequantizing_gather(self) -> GgmlGather | None:
        """The gather that writes fp16 images (f16_gemm of a type whose blocks are not), from
        the format's decoder_source where it has one."""
        if self.decoder_source is None:
            return GgmlGather(self.runtime)
        return GgmlGather(self.runtime, source=self.decoder_source, decoders=self._own)

    def dequantizing_gather(self, stream: Any, srcs: list[int], first_pos: int, gu_buf: int,
                            down_buf: int, bounds: int = 0, first_expert: int = 0) -> None:
        """fp16 images of the blobs at srcs at positions first_pos.. of the group buffers: the
        gate/up rows (2*ffn x hidden, gate rows then up rows as the blob holds them) in one
        launch, the down rows (hidden x ffn) in another; members without rows in `bounds`
        skipped (gather_routed)."""
        if self._dequant is None:
            raise FormatError(f"{self.fmt.name}: no dequantizing gather was opened")
        lay = self.layout
        check_aligned({"gate/up buffer": gu_buf + first_pos * lay.gate_up_image_bytes,
                       "down buffer": down_buf + first_pos * lay.down_image_bytes})
        for decoder, offset, buf, rows, cols, stride in (
                (self.decoder, lay.gate_up_offset, gu_buf, 2 * lay.ffn, lay.hidden,
                 lay.gate_up_image_bytes),
                (self.down_decoder, lay.down_offset, down_buf, lay.hidden, lay.ffn,
                 lay.down_image_bytes)):
            self._dequant.gather(stream, decoder, [int(s) + offset for s in srcs], buf, rows,
                                 cols, first_pos=first_pos, image_stride=stride, bounds=bounds,
                                 first_expert=first_expert)

    def fused(self) -> GgmlFused:
        """The decoding GEMM's launchers, opened on first use."""
        if self._fused is None:
            self._fused = GgmlFused(self.runtime) if self.decoder_source is None else GgmlFused(
                self.runtime, source=self.decoder_source, decoders=self._own)
        return self._fused

    def gemv(self) -> GgmlGemv:
        """The matrix-vector kernels' launchers, opened on first use."""
        if self._gemv is None:
            self._gemv = GgmlGemv(self.runtime) if self.decoder_source is None else GgmlGemv(
                self.runtime, source=self.decoder_source, decoders=self._own)
        return self._gemv

    def fused_gemm(self, stream: Any, weights: int, expert_ids: tuple[int, ...], acts: int,
                   bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        """Products of native images in a group buffer, decoded in the GEMM's main loop."""
        self.fused().gemm(stream, self.part_decoder(m, k), weights, expert_ids, acts, bounds,
                          out, m, k, rows_hint)

    def fused_gemm_at(self, stream: Any, sources: list[int], expert_ids: tuple[int, ...],
                      acts: int, bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        """fused_gemm with position p's native image read at sources[p]."""
        self.fused().gemm_at(stream, self.part_decoder(m, k), sources, expert_ids, acts,
                             bounds, out, m, k, rows_hint)

    def fused_gemm_table(self, stream: Any, table: int, offset: int, acts: int, bounds: int,
                         out: int, m: int, k: int, rows_hint: int, n_experts: int) -> None:
        """fused_gemm_at over every expert of a layer in one launch, expert e's native image
        at table[e] + offset."""
        self.fused().gemm_table(stream, self.part_decoder(m, k), table, offset, acts, bounds,
                                out, m, k, rows_hint, n_experts)

    def part_decoder(self, m: int, k: int) -> GgmlKey:
        """The decoder of the product's part: down is m = hidden, k = ffn (gate/up is
        m = 2 * ffn, k = hidden, never the same pair)."""
        lay = self.layout
        return self.down_decoder if (m, k) == (lay.hidden, lay.ffn) else self.decoder

    # ------------------------------------------------------------------ FormatKernels
    def gather(self, stream, src: int, pos: int, gu_buf: int, down_buf: int) -> None:
        if self._copy is not None:
            self._copy.gather(stream, src, pos, gu_buf, down_buf)
        else:
            self.dequantizing_gather(stream, [src], pos, gu_buf, down_buf)

    def gather_batch(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                     down_buf: int) -> None:
        if self._copy is not None:
            self._copy.gather_batch(stream, srcs, first_pos, gu_buf, down_buf)
        else:
            self.dequantizing_gather(stream, list(srcs), first_pos, gu_buf, down_buf)

    def gather_routed(self, stream, srcs: list[int], gu_buf: int, down_buf: int, bounds: int,
                      first_expert: int) -> None:
        if self._copy is not None:
            self._copy.gather_routed(stream, srcs, gu_buf, down_buf, bounds, first_expert)
        else:
            self.dequantizing_gather(stream, list(srcs), 0, gu_buf, down_buf, bounds,
                                     first_expert)

    @property
    def fallbacks(self) -> int:
        """Batches the byte copy ran one expert at a time (NativeKernels.fallbacks); the
        dequantizing gather has no fallback (it refuses a misaligned address)."""
        return 0 if self._copy is None else self._copy.fallbacks

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        if self._gemm is not None:
            self._gemm.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)
        else:
            self.fused_gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint)

    def gemv_routed(self, stream, experts: int, ids: int, row_of: int, acts: int, mid: int,
                    out: int, pairs: int, host_reads: bool = False) -> None:
        lay = self.layout
        g = self.gemv()
        g.launch(stream, "gate_up", self.decoder, experts, lay.gate_up_offset, ids, row_of,
                 acts, mid, pairs, lay.hidden, lay.ffn, host_reads)
        g.launch(stream, "down", self.down_decoder, experts, lay.down_offset, ids, row_of, mid,
                 out, pairs, lay.hidden, lay.ffn, host_reads)

    def mmq_in_place(self, stream, sources: list[int], expert_ids: tuple[int, ...], acts: int,
                     bounds: int, out: int, m: int, k: int, rows_hint: int) -> None:
        if self.fmt.in_place_max_rows <= 0:
            super().mmq_in_place(stream, sources, expert_ids, acts, bounds, out, m, k,
                                 rows_hint)
        self.fused_gemm_at(stream, sources, expert_ids, acts, bounds, out, m, k, rows_hint)

    def mmq_table(self, stream, table: int, offset: int, acts: int, bounds: int, out: int,
                  m: int, k: int, rows_hint: int, n_experts: int) -> None:
        if self.fmt.in_place_max_rows <= 0:
            super().mmq_table(stream, table, offset, acts, bounds, out, m, k, rows_hint,
                              n_experts)
        self.fused_gemm_table(stream, table, offset, acts, bounds, out, m, k, rows_hint,
                              n_experts)
