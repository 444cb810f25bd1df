"""Grouped fp16 GEMM for every format whose group buffers hold fp16 images, and the IQ3_XXS
dequantizing gather that produces such images from native blocks.

Why two phases: the exact q8_1 MMQ kernels spend most of their instructions on a per-32-value
float epilogue. Dequantizing a group's experts once into fp16 images (one launch per group,
read 98 bytes, write 512 per block of 256 weights) leaves a plain fp16 x fp16 -> fp32 GEMM over
the whole K, which tensor cores run at several times the rate.

`GroupedGemm.gemm` has the signature of `FormatKernels.mmq`, so a format's launcher can delegate
to it; `gemm_reference` is the numpy twin the tests compare with (the dequantizing gather's twin
is strata_rt.gemm.ggml_gather.images_reference, whose bytes the IQ3_XXS gather gives too).

Numerics: the GEMM accumulates each output in fp32, one mma per 16 values of K in ascending
order from a zero accumulator, so its bytes do not depend on the tile shape, on rows_hint or on
the run. It agrees with a float64 product of the same fp16 inputs within a tolerance (tensor
cores do not round like sequential IEEE adds). The dequantizing gather is exact: each weight is
fp16(round to nearest even) of the float32 value IQ3XXS.dequantize gives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..errors import FormatError
from ..formats.contract import MMQ_GROUP, ExpertLayout, expert_rows, first_misaligned
from ..formats.launchers import MMQ_ARG_TYPES, MmqTile, check_aligned, launch_mmq, pick_by_rows
from ..resources import KERNELS_ROOT, kernel_lines
from .cutlass_gemm import CUTLASS_BY_NAME, CutlassGemm, cutlass_for, cutlass_tile

if TYPE_CHECKING:
    from ..runtime import Runtime

GEMM_SOURCE = KERNELS_ROOT / "common" / "gemm_f16.cu"
DEQUANT_SOURCE = KERNELS_ROOT / "iq3_xxs" / "dequant.cu"
#: weight rows per block (BN in gemm_f16.cu); m must be a multiple
TILE_N = 128
#: k must be a multiple of every tile's K step
K_MULTIPLE = 64
IQ3_BLOCK_BYTES = 98
IQ3_BLOCK_VALUES = 256
DQ_THREADS = 256
DQ_UNROLL = 4
#: CUDA blocks one dequantizing launch aims for (spread over its experts)
DQ_TARGET_BLOCKS = 2048


@dataclass(frozen=True)
class GemmTile:
    """One compiled GEMM kernel: BM activation rows x 128 weight rows per block, warps owning
    wm x wn sub-tiles, K stepped bk values per stage through `stages` shared-memory buffers.
    Mirrors a GEMM_KERNEL line of gemm_f16.cu."""

    name: str
    bm: int
    wm: int
    wn: int
    bk: int
    stages: int
    min_blocks: int

    @property
    def threads(self) -> int:
        return 32 * (self.bm // self.wm) * (TILE_N // self.wn)

    @property
    def smem(self) -> int:
        """Dynamic shared memory of one block (the kernel traps when given less)."""
        return self.stages * (self.bm + TILE_N) * self.bk * 2

    @property
    def launch(self) -> MmqTile:
        """The geometry the common MMQ launch takes (every tile accepts the same k)."""
        return MmqTile(m=TILE_N, rows=self.bm, threads=self.threads, k_multiple=K_MULTIPLE,
                       shared=self.smem)


#: every kernel of gemm_f16.cu, read from its GEMM_KERNEL lines (the one copy of the table)
TILES = tuple(GemmTile(name, *(int(v) for v in args))
              for name, *args in kernel_lines(GEMM_SOURCE, "GEMM_KERNEL"))
TILES_BY_NAME = {t.name: t for t in TILES}
#: (largest rows_hint, tile) in order; beyond the last bound the last tile. First guesses, to be
#: set from bench/bench_gemm.py's per-tile sweep: small tiles waste fewer zero rows on experts
#: with few rows, large ones read each operand fewer times.
TILE_RULE = ((48, "gemm_f16_m32"), (160, "gemm_f16_m64"), (None, "gemm_f16_m128"))
#: from this rows_hint on, a launch on sm_90 goes to the CUTLASS wgmma kernels
#: (strata_rt.gemm.cutlass_gemm, which picks among its own tiles) when they are available; below
#: it the own small tiles win (bench/bench_gemm.py's sweep: 512-token layers, busiest expert
#: of a group 6-85 rows)
CUTLASS_MIN_ROWS = 96


def pick_tile(rows_hint: int) -> GemmTile:
    """The tile `gemm` uses for a launch sized for rows_hint rows per expert."""
    return pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint)


def fp16_image_bytes(hidden: int, ffn: int) -> tuple[int, int]:
    """Bytes of an expert's fp16 gate/up image [2*ffn, hidden] and down image [hidden, ffn]."""
    return 2 * ffn * hidden * 2, hidden * ffn * 2


def fp16_image_layout(layout: ExpertLayout) -> ExpertLayout:
    """A format's blob layout with fp16 images in the group buffers: the same blob ranges, image
    bytes 2 * rows * cols (what a format that gathers into fp16 images reports)."""
    gu, dn = fp16_image_bytes(layout.hidden, layout.ffn)
    return replace(layout, gate_up_image_bytes=gu, down_image_bytes=dn)


def fp16_image_values(image: np.ndarray, rows: int, cols: int, what: str) -> np.ndarray:
    """One fp16 image (uint8, 2 * rows * cols bytes) as float32 [rows, cols]; `what` names the
    format in the error."""
    raw = np.ascontiguousarray(image, dtype=np.uint8).reshape(-1)
    if raw.size != 2 * rows * cols:
        raise FormatError(f"{what}: an fp16 image of {rows} x {cols} takes {2 * rows * cols} "
                          f"bytes, got {raw.size}")
    return raw.view(np.float16).reshape(rows, cols).astype(np.float32)


class GroupedGemm:
    """Prepared launches of gemm_f16.cu (every tile) and, unless `iq3_gather` is False (a
    format whose blobs already are fp16 images), of the IQ3_XXS dequantizing gather on one
    runtime."""

    def __init__(self, runtime: Runtime, *, iq3_gather: bool = True):
        self.runtime = runtime
        mod = runtime.module(GEMM_SOURCE)
        self._gemm = {t.name: mod.kernel(t.name, MMQ_ARG_TYPES) for t in TILES}
        #: the sm_90 kernels for large launches, or None (the own kernels serve every size)
        self._cutlass = cutlass_for(runtime)
        self._dequant = runtime.module(DEQUANT_SOURCE).kernel(
            "iq3_dequant_gather", "P" * MMQ_GROUP + "PPqqqqqqiPi") if iq3_gather else None

    def gemm(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
             out: int, m: int, k: int, rows_hint: int, *, tile: str | None = None) -> None:
        """out[r, :] = W_p @ acts[r, :] for every row r of every expert of the group (the
        FormatKernels.mmq contract with fp16 images of exactly 2*m*k bytes at weights +
        p*2*m*k, and fp16 activations [rows, k]). `tile` names a kernel of TILES instead of
        the one pick_tile chooses (same bytes, other speed), or of CUTLASS_TILES where the
        CUTLASS kernels are available."""
        cutlass = self._cutlass_for(rows_hint, tile)
        if cutlass is not None:
            cutlass.gemm(stream, weights, expert_ids, acts, bounds, out, m, k, rows_hint,
                         tile=tile)
            return
        chosen = pick_by_rows(TILE_RULE, TILES_BY_NAME, rows_hint, tile, "fp16 GEMM")
        launch_mmq(self._gemm[chosen.name], chosen.launch, "fp16 GEMM", stream, weights,
                   expert_ids, acts, bounds, out, m, k, rows_hint)

    def _cutlass_for(self, rows_hint: int, tile: str | None) -> CutlassGemm | None:
        """The CUTLASS kernels when this launch goes to them, else None."""
        cutlass = self._cutlass
        if cutlass is None:
            return None
        if tile is None:
            return cutlass if rows_hint >= CUTLASS_MIN_ROWS else None
        return cutlass if tile in CUTLASS_BY_NAME else None

    def tile_name(self, rows_hint: int) -> str:
        """The kernel `gemm` runs for rows_hint when no tile is named."""
        cutlass = self._cutlass_for(rows_hint, None)
        return (cutlass_tile(rows_hint).name if cutlass is not None
                else pick_tile(rows_hint).name)

    def dequant_gather_iq3(self, stream, srcs: list[int], first_pos: int, gu_buf: int,
                           down_buf: int, layout: ExpertLayout, bounds: int = 0,
                           first_expert: int = 0) -> None:
        """One launch: the IQ3_XXS blobs at srcs (1..16 device addresses) become fp16 images at
        positions first_pos.. of the group buffers. `layout` is the IQ3_XXS blob layout with
        fp16 image bytes (fp16_image_layout); position p's images sit at gu_buf +
        p*gate_up_image_bytes and down_buf + p*down_image_bytes. Bytes equal
        images_reference of each part, whatever the batch size. bounds (a layer's device
        row offsets; 0: none): members are experts first_expert.., and one without rows is
        skipped on the device (FormatKernels.gather_routed)."""
        if self._dequant is None:
            raise FormatError("this GroupedGemm was opened without the IQ3_XXS dequantizing "
                              "gather (iq3_gather=False)")
        n = len(srcs)
        if not 1 <= n <= MMQ_GROUP or not 0 <= first_pos <= MMQ_GROUP - n:
            raise FormatError(
                f"dequantizing gather of {n} experts at position {first_pos}: a batch holds "
                f"1..{MMQ_GROUP} experts and must end by position {MMQ_GROUP - 1}")
        gu_blocks, dn_blocks = _iq3_blocks(layout)
        gu_img, dn_img = fp16_image_bytes(layout.hidden, layout.ffn)
        if (layout.gate_up_image_bytes, layout.down_image_bytes) != (gu_img, dn_img):
            raise FormatError(
                f"dequantizing gather: layout image bytes ({layout.gate_up_image_bytes}, "
                f"{layout.down_image_bytes}) are not the fp16 images' ({gu_img}, {dn_img}); "
                "pass fp16_image_layout(layout)")
        check_aligned({"gate/up buffer": gu_buf + first_pos * gu_img,
                       "down buffer": down_buf + first_pos * dn_img})
        named = {"gate/up offset": layout.gate_up_offset, "down offset": layout.down_offset}
        named.update({f"source {i}": s for i, s in enumerate(srcs)})
        why = first_misaligned(named, align=2)
        if why is not None:
            raise FormatError(f"dequantizing gather reads 2-byte words: {why}")
        total = gu_blocks + dn_blocks
        per_block = DQ_THREADS // 32 * DQ_UNROLL
        gx = max(1, min(-(-DQ_TARGET_BLOCKS // n), -(-total // per_block)))
        ptrs = list(srcs) + [0] * (MMQ_GROUP - n)
        self._dequant.launch(
            grid=(gx, n, 1), block=(DQ_THREADS, 1, 1), stream=stream,
            args=(*ptrs, gu_buf, down_buf, layout.gate_up_offset, gu_blocks, layout.down_offset,
                  dn_blocks, gu_img, dn_img, first_pos, bounds, first_expert))


def _iq3_blocks(layout: ExpertLayout) -> tuple[int, int]:
    """98-byte blocks of the gate/up and down ranges, checked against the geometry."""
    h, f = layout.hidden, layout.ffn
    want = (2 * f * h // IQ3_BLOCK_VALUES, h * f // IQ3_BLOCK_VALUES)
    got = (layout.gate_up_bytes / IQ3_BLOCK_BYTES, layout.down_bytes / IQ3_BLOCK_BYTES)
    if h % IQ3_BLOCK_VALUES or f % IQ3_BLOCK_VALUES or got != want:
        raise FormatError(
            f"layout (hidden {h}, ffn {f}, gate/up {layout.gate_up_bytes} bytes, down "
            f"{layout.down_bytes} bytes) is not an IQ3_XXS blob: want hidden and ffn multiples "
            f"of {IQ3_BLOCK_VALUES} and {want[0]} + {want[1]} blocks of {IQ3_BLOCK_BYTES} bytes")
    return want


# ---------------------------------------------------------------------------- numpy twins
def gemm_reference(images: np.ndarray, expert_ids: tuple[int, ...], acts_f16: np.ndarray,
                   bounds: np.ndarray, m: int, k: int) -> np.ndarray:
    """float64 products of the fp16 images (uint8 [n, >= 2*m*k] or float16 [n, m, k]) and fp16
    activations [rows, k], rounded to float32 [rows, m]; rows of experts outside the group are
    zero."""
    x = np.asarray(acts_f16)
    if x.dtype != np.float16 or x.ndim != 2 or x.shape[1] != k:
        raise FormatError(f"activations must be float16 [rows, {k}], got {x.dtype} {x.shape}")
    img = np.ascontiguousarray(images).view(np.uint8).reshape(len(expert_ids), -1)
    if img.shape[1] < 2 * m * k:
        raise FormatError(f"images hold {img.shape[1]} bytes each; an {m} x {k} fp16 image "
                          f"takes {2 * m * k}")
    out = np.zeros((x.shape[0], m), dtype=np.float32)
    for p, r0, r1 in expert_rows(expert_ids, bounds):
        if r1 > r0:
            w = img[p, : 2 * m * k].view(np.float16).reshape(m, k).astype(np.float64)
            out[r0:r1] = x[r0:r1].astype(np.float64) @ w.T
    return out
