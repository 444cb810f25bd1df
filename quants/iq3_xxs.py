"""IQ3_XXS: GGUF's 3.06-bit i-quant, the format strata_rt's kernels are built around.

A GGMLFormat (fp16 products f16_gemm, the default, and f16_fused; byte-copy GGUF loading), with
what the generic type lacks: exact dequantization in its integer form (bit for bit what the
`gguf` package produces), a vectorized quantizer following llama.cpp's reference algorithm,
random valid blocks for synthetic models, and four exact MMQ variants on q8_1 activations
(f16_pipe, f16, int8, int8_occ2; `exact_mmq_reference` is their numpy mirror). Its fp16
variants run its own kernels (kernels/iq3_xxs: the dequantizing gather, the same bytes as the
generic GGML one, and the GEMM decoding blocks in its main loop); the launchers live in
`iq3_xxs_device`, imported only when asked for.

Block (256 weights, 98 bytes): fp16 d; 64 grid indices (8 per 32-weight sub-block, each naming
four magnitudes); 8 uint32 words, one per sub-block: four 7-bit sign indices (one per 8
weights) and the sub-block scale s in bits 28-31. weight = d * (0.5 + s) * 0.5 * magnitude * sign.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strata_rt.errors import FormatError
from strata_rt.formats.activations import Q8_1Acts
from strata_rt.formats.contract import FormatKernels, QuantFormat, expert_rows
from strata_rt.formats.ggml_format import F16_FUSED, F16_GEMM, GGMLFormat
from strata_rt.formats.hookspecs import hookimpl
from strata_rt.resources import KERNELS_ROOT

from .iq3_xxs_quantize import (
    BLOCK_BYTES,
    CHUNK_BLOCKS,
    F32,
    GRID_MAG,
    NSUB,
    QK,
    QS_END,
    SIGN_SHIFTS,
    SUB,
    quantize_blocks,
)

#: 7-bit sign index -> 8-bit negative mask; bit 7 restores even parity
SIGN_MASK = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.uint8)
_BITS8 = np.arange(8, dtype=np.uint8)
#: largest magnitude a block can store: fp16 max d * (0.5 + 15) * 0.5 * grid magnitude 62. The
#: search picks scales up to max/12 per sub-block, so from ~2.4e7 a block's d may overflow.
MAX_WEIGHT = 65504.0 * 15.5 * 0.5 * 62
#: blocks whose largest |weight| passes this are refused without a search: no fp16 scale can
#: represent such a weight (any finite d would clip it), and from ~1e13 the search's float32
#: sums overflow into NaN; below it a block is refused only if its chosen d overflows
_AMAX_LIMIT = F32(MAX_WEIGHT)
_REF_CHUNK = 128  # activation rows the MMQ reference multiplies at once (bounds its scratch)


def _mean_square_weight() -> float:
    """E[((0.5+s)/2 * magnitude)^2] for uniform random s and grid index: what a random block
    with d = 1 dequantizes to, squared, on average."""
    s = np.arange(16) + 0.5
    return float(np.mean((s / 2) ** 2) * np.mean(GRID_MAG.astype(np.float64) ** 2))


class IQ3XXS(GGMLFormat):
    ggml = "IQ3_XXS"
    name = "iq3_xxs"
    kernel_dir = "iq3_xxs"
    dim_multiple = QK
    #: measured 0.0454-0.0455 on Gaussian 2048 x 768 without an importance vector (llama.cpp's
    #: x^2 weighting trades small weights for large ones); 0.033 with a uniform importance vector
    roundtrip_nmse = 0.05
    quantizes = True  # its own quantizer (the gguf package has none for IQ3_XXS)
    description = ("GGUF IQ3_XXS, 3.06 bits/weight: experts keep the GGUF's bytes; default "
                   "f16_gemm (dequantizing gather to fp16 images, grouped fp16 GEMM on fp16 "
                   "activations; on short chunks resident experts are read in place, no "
                   "gather); f16_fused (blocks decoded inside the GEMM); f16_pipe, f16, int8, "
                   "int8_occ2: exact MMQ on q8_1 activations; batched gathers")

    def exact_variants(self) -> tuple[str, ...]:
        """The exact MMQ kernels on q8_1 activations, fastest measured first."""
        from .iq3_xxs_device import MMQ_VARIANTS

        return MMQ_VARIANTS

    # ------------------------------------------------------------------ bytes -> values
    def _blocks(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        rows, cols = shape
        want = self.matrix_bytes(rows, cols)
        b = np.asarray(raw, dtype=np.uint8).reshape(-1)
        if b.size != want:
            raise FormatError(f"{self.name}: {b.size} bytes given for a {rows} x {cols} matrix, "
                              f"which takes {want} bytes ({cols // QK} blocks of 98 per row)")
        return b.reshape(rows, cols // QK, BLOCK_BYTES)

    def _unpack(self, raw: np.ndarray, shape: tuple[int, int]):
        """(d [rows, nb] f32, s [rows, nb, 8] u8, magnitude [rows, nb, 8, 32] u8,
        negative [rows, nb, 8, 32] bool)."""
        blk = self._blocks(raw, shape)
        rows, nb = blk.shape[:2]
        d = np.ascontiguousarray(blk[..., :2]).view("<f2")[..., 0].astype(F32)
        words = np.ascontiguousarray(blk[..., QS_END:]).view("<u4")
        s = (words >> np.uint32(28)).astype(np.uint8)
        masks = SIGN_MASK[(words[..., None] >> SIGN_SHIFTS) & np.uint32(0x7F)]
        negative = ((masks[..., None] >> _BITS8) & 1).astype(bool).reshape(rows, nb, NSUB, SUB)
        magnitude = GRID_MAG[blk[..., 2:QS_END]].reshape(rows, nb, NSUB, SUB)
        return d, s, magnitude, negative

    def decode(self, raw: np.ndarray, shape: tuple[int, int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Raw bytes of a [rows, cols] matrix -> (d float32 [rows, nb], s uint8 [rows, nb, 8],
        q int8 [rows, cols] = sign * magnitude): the integer form the MMQ works on."""
        d, s, magnitude, negative = self._unpack(raw, shape)
        q = np.where(negative, -magnitude.astype(np.int8), magnitude.astype(np.int8))
        return d, s, q.reshape(shape)

    def dequantize(self, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        d, s, magnitude, negative = self._unpack(raw, shape)
        db = d[..., None] * (F32(0.5) + s.astype(F32)) * F32(0.5)
        sign = np.where(negative, F32(-1), F32(1))
        return (db[..., None] * magnitude.astype(F32) * sign).reshape(shape)

    # ------------------------------------------------------------------ values -> bytes
    def quantize(self, weights: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """float32 [rows, cols] -> IQ3_XXS bytes [rows, cols/256*98], llama.cpp's way.

        Matches llama.cpp's reference IQ3_XXS quantizer (quantize_row_iq3_xxs_impl, 256-point
        grid) step for step: weights x^2, or imatrix[col] * sqrt(2*mean(x^2 of the block) + x^2)
        with an importance vector; per group of 8, an odd number of negatives is made even by
        keeping the sign of the weight with least weight*x^2 wrong; 31 trial scales
        (15 + 0.2*t)/max for t = -15..15; levels by round-half-even of (x*id - 1)/2 clamped to
        0..7; off-grid groups of four moved to the best of their nearest and second-nearest
        grid neighbours; the trial with the largest sumqx^2/sumq2 wins; off-grid groups re-snapped
        at the winning scale and the scale refitted; d = fp16(max_scale/31 * 1.0125), s =
        round((scale/(max_scale/31) - 1)/2) clamped to 0..15; sub-blocks with max |x| < 1e-8
        get s = 0, grid index 0, no signs; all-zero blocks are all-zero bytes. Arithmetic is
        float32 with the C loops' summation order. Refused with a FormatError naming row and
        column: NaN/Inf weights, and a block whose scale d overflows fp16 (a weight beyond
        about 2.4e7 to MAX_WEIGHT = 3.1e7), where llama.cpp would store an infinite scale.

        Does not match: bytes are not guaranteed identical to llama.cpp's binary, whose compiler
        may fuse multiplies and adds (FMA) and so round some near-ties the other way; this is not
        tested against llama.cpp. Where a sub-block's weights are all zero-importance (no trial
        wins), llama.cpp keeps whatever levels the previous sub-block left; this one uses level
        0 and scale max/15. Like llama.cpp, the search models level 7 as 15 although the grid
        stores 62/4 = 15.5.
        """
        w = self.check_weights(weights)
        rows, cols = w.shape
        qw = None
        if imatrix is not None:
            qw = np.asarray(imatrix)
            if qw.shape != (cols,):
                raise FormatError(f"{self.name}: importance vector has shape {qw.shape}; the "
                                  f"weights have {cols} columns, so it must have shape ({cols},)")
            qw = qw.astype(F32)
            if not np.isfinite(qw).all() or (qw < 0).any():
                raise FormatError(f"{self.name}: importance vector must be finite and >= 0")
        nb = cols // QK
        x = w.reshape(rows * nb, QK)
        huge = np.abs(x).max(1, initial=0) > _AMAX_LIMIT
        if huge.any():
            x = np.where(huge[:, None], F32(0), x)
        out = np.empty((rows * nb, BLOCK_BYTES), np.uint8)
        # like llama.cpp's float32 C loops, the search's sums may overflow for large weights
        with np.errstate(over="ignore"):
            for lo in range(0, rows * nb, CHUNK_BLOCKS):
                hi = min(lo + CHUNK_BLOCKS, rows * nb)
                part = None if qw is None else qw.reshape(nb, QK)[np.arange(lo, hi) % nb]
                out[lo:hi] = quantize_blocks(x[lo:hi], part)
        bad = huge | ~np.isfinite(out[:, :2].copy().view("<f2")[:, 0])
        if bad.any():
            raise self._scale_overflow(w, int(np.flatnonzero(bad)[0]))
        return out.reshape(rows, nb * BLOCK_BYTES)

    def _scale_overflow(self, w: np.ndarray, block: int) -> FormatError:
        r, b = divmod(block, w.shape[1] // QK)
        c0 = b * QK
        c = c0 + int(np.argmax(np.abs(w[r, c0: c0 + QK])))
        return FormatError(
            f"{self.name}: the block at row {r}, columns {c0}-{c0 + QK - 1} needs a scale "
            f"beyond fp16's range: its largest weight, {float(w[r, c]):.4g} at row {r}, column "
            f"{c}, is too large for IQ3_XXS (a block holds magnitudes up to about 2.4e7 to "
            f"{MAX_WEIGHT:.2g}, depending on its other weights)")

    # ------------------------------------------------------------------ experts
    def _random_matrix(self, rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
        """Random valid blocks whose values have standard deviation ~ 1/sqrt(cols). Every byte
        pattern of the grid indices and sign/scale words is valid, so only d needs care."""
        nblk = rows * self.row_bytes(cols) // BLOCK_BYTES
        blocks = rng.integers(0, 256, (nblk, BLOCK_BYTES), dtype=np.uint8)
        d = cols ** -0.5 / np.sqrt(_mean_square_weight()) * rng.uniform(0.75, 1.25, nblk)
        blocks[:, :2] = d.astype("<f2").view(np.uint8).reshape(nblk, 2)
        return blocks.reshape(-1)

    def random_expert(self, rng: np.random.Generator, hidden: int, ffn: int) -> np.ndarray:
        """A synthetic expert of random valid blocks (random grid indices, signs and scales;
        d chosen so weights have std ~ 1/sqrt(row length)), not quantized from weights: fast,
        and as good as any other bytes for exercising the kernels and the engine."""
        self.check_dims(hidden, ffn)
        return np.concatenate([self._random_matrix(rng, ffn, hidden),
                               self._random_matrix(rng, ffn, hidden),
                               self._random_matrix(rng, hidden, ffn)])

    # ------------------------------------------------------------------ device side
    def exact_mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...],
                            acts: Q8_1Acts, bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        """numpy mirror of every exact MMQ variant, bit for bit. Per output (activation row r,
        weight row i), over the 32-value sub-blocks j of K in ascending order:

            idot  = sum of q_w * q_a                 (int, exact)
            rint  = (2*s_ij + 1) * idot              (int, exact, |rint| < 2^23)
            scale = fl(dq_i * da_rj)                 (dq = fp16 d * 0.25, exact; da = q8_1 scale)
            acc   = fl(acc + fl(scale * rint))       (float32, round to nearest, no FMA)

        Integer dots are exact float64 products of small integers (BLAS-fast, |sum| < 2^53);
        the float32 accumulation then runs over the sub-blocks in ascending order."""
        if acts.q.shape[1] != k:
            raise FormatError(f"activations hold K={acts.q.shape[1]} values per row; the MMQ "
                              f"has k={k}")
        out = np.zeros((acts.q.shape[0], m), dtype=F32)
        nsub = k // SUB
        img = np.asarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
        for p, r0, r1 in expert_rows(expert_ids, bounds):
            if r1 <= r0:
                continue
            d, s, q = self.decode(img[p], (m, k))
            dq = (d * F32(0.25)).repeat(NSUB, axis=1)                       # [m, nsub]
            s21 = (2.0 * s.astype(np.float64) + 1.0).reshape(m, nsub)
            wq = q.astype(np.float64).reshape(m, nsub, SUB).transpose(1, 2, 0)
            for c0 in range(r0, r1, _REF_CHUNK):
                c1 = min(r1, c0 + _REF_CHUNK)
                aq = acts.q[c0:c1].astype(np.float64).reshape(c1 - c0, nsub, SUB)
                idot = np.matmul(aq.transpose(1, 0, 2), wq)                  # [nsub, rows, m]
                rint = (idot * s21.T[:, None, :]).astype(F32)                # exact integers
                da = acts.d[c0:c1]
                acc = np.zeros((c1 - c0, m), dtype=F32)
                for j in range(nsub):
                    acc = acc + (dq[None, :, j] * da[:, j, None]) * rint[j]
                out[c0:c1] = acc
        return out

    def kernel_sources(self) -> list[Path]:
        """f16_gemm: the dequantizing gather and the GEMM that reads native blocks in place;
        f16_fused: that GEMM (the byte copies and the fp16 GEMM are kernels/common's); exact
        variants: every source of the folder, the exact MMQ among them."""
        folder = KERNELS_ROOT / self.kernel_dir
        if self.variant == F16_GEMM:
            return [folder / "dequant.cu", folder / "fused.cu"]
        if self.variant == F16_FUSED:
            return [folder / "fused.cu"]
        return sorted(folder.glob("*.cu"))

    def kernels_class(self) -> type[FormatKernels]:
        from .iq3_xxs_device import IQ3XXSF16Kernels, IQ3XXSKernels

        return IQ3XXSF16Kernels if self.runs_f16 else IQ3XXSKernels


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [IQ3XXS()]
