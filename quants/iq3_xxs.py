"""IQ3_XXS: GGUF's 3.06-bit i-quant, the format strata_rt's kernels are built around.

Host side of the plugin: exact dequantization (bit for bit what the `gguf` package produces),
a vectorized quantizer following llama.cpp's reference algorithm, random valid blocks for
synthetic models, and expert packing straight from GGUF bytes. The device side (gathers, MMQ
and its numpy mirror) lives in `iq3_xxs_device` and is imported only when asked for, so this
module loads on machines without CUDA.

Block (256 weights, 98 bytes): fp16 d; 64 grid indices (8 per 32-weight sub-block, each naming
four magnitudes); 8 uint32 words, one per sub-block: four 7-bit sign indices (one per 8
weights) and the sub-block scale s in bits 28-31. weight = d * (0.5 + s) * 0.5 * magnitude * sign.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType

from strata_rt.errors import FormatError, GGUFError
from strata_rt.formats import FormatKernels, QuantFormat
from strata_rt.hookspecs import hookimpl

from .iq3_xxs_grid import GRID, LEVELS

if TYPE_CHECKING:
    pass

F32 = np.float32
QK = 256  # weights per block
SUB = 32  # weights per sub-block (one scale, one sign word)
NSUB = QK // SUB
BLOCK_BYTES = 98
_QS_END = 2 + QK // 4  # grid indices occupy bytes 2..65, sign/scale words 66..97

_GRID_U32 = np.array(GRID, dtype=np.uint32)
#: [256, 4] magnitudes of each grid point (byte j of the packed entry)
GRID_MAG = ((_GRID_U32[:, None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF).astype(np.uint8)
#: [256, 4] level codes 0..7 of each grid point (index into LEVELS)
GRID_LEVEL = np.searchsorted(np.array(LEVELS), GRID_MAG).astype(np.int32)
#: [256, 4] the odd integers 2l+1 the quantizer's search measures grid points in
_GRID_ODD = (2 * GRID_LEVEL + 1).astype(F32)
#: 7-bit sign index -> 8-bit negative mask; bit 7 restores even parity
SIGN_MASK = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.uint8)
_SIGN_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)
_BITS8 = np.arange(8, dtype=np.uint8)
_LEVEL_SHIFTS = np.array([0, 3, 6, 9], dtype=np.int32)
#: packs a group's four level codes into one 12-bit code l0 | l1<<3 | l2<<6 | l3<<9
_LEVEL_WEIGHTS = np.array([1, 8, 64, 512], dtype=np.int32)

# llama.cpp's constants for IQ3_XXS: 8 levels (quantizer works with odd integers 2l+1), the 31
# trial scales, the all-zero threshold of a sub-block and the fudge factor applied to d.
_KMAXQ = 8
_TRIALS = range(-15, 16)
_GROUP_MAX_EPS = F32(1e-8)
_D_FUDGE = F32(1.0125)
_CHUNK_BLOCKS = 4096  # blocks quantized per numpy pass (bounds temporary memory)


@lru_cache(maxsize=1)
def _search_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The quantizer's lookups, built once: level codes of a group of four packed as
    l0 | l1<<3 | l2<<6 | l3<<9 -> grid index (-1 when the point is not on the grid), and for
    each off-grid point the grid points it may move to, in CSR form (ptr, idx).

    The candidates are as llama.cpp defines them: every grid point at the smallest or the
    second-smallest distinct squared distance (in odd-integer coordinates 2l+1), ordered by
    (distance, grid index)."""
    codes = GRID_LEVEL @ _LEVEL_WEIGHTS
    kmap = np.full(8 ** 4, -1, dtype=np.int64)
    kmap[codes] = np.arange(256)
    points = (np.arange(8 ** 4)[:, None] >> _LEVEL_SHIFTS) & 7
    dist = (((2 * points[:, None, :] + 1) - (2 * GRID_LEVEL[None] + 1)) ** 2).sum(-1)
    first = dist.min(1, keepdims=True)
    second = np.where(dist > first, dist, np.iinfo(dist.dtype).max).min(1, keepdims=True)
    order = np.argsort(dist * 256 + np.arange(256), axis=1, kind="stable")
    chosen = np.take_along_axis(dist, order, 1) <= second
    chosen[kmap >= 0] = False
    counts = chosen.sum(1)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    return kmap, ptr, order[chosen]


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis left to right in float32, the order of llama.cpp's C loops
    (numpy's own sum is pairwise and could round differently)."""
    acc = a[..., 0].copy()
    for i in range(1, a.shape[-1]):
        acc += a[..., i]
    return acc


def _levels(xval: np.ndarray, inv_scale: np.ndarray) -> np.ndarray:
    """Nearest level l with (2l+1)*scale ~ x, clamped to 0..7 (llama.cpp's nearest_int rounds
    half to even, as np.rint does)."""
    lv = np.rint(F32(0.5) * (inv_scale[:, None] * xval - F32(1)))
    return np.clip(lv, 0, _KMAXQ - 1).astype(np.int32)


def _as_groups(items: np.ndarray) -> np.ndarray:
    return items.view(F32).reshape(-1, 4)


def _snap_to_grid(lv: np.ndarray, xval: np.ndarray, waux: np.ndarray,
                  scale: np.ndarray) -> np.ndarray:
    """Moves every group of four whose levels are not a grid point to its best candidate
    neighbour (least sum of waux * (scale*(2l+1) - x)^2, first in candidate order on ties).
    lv is a contiguous [n, 32] array, updated in place; returns the [n, 8] mask of groups
    that were off the grid. Candidates of all off-grid groups are scored in one flat pass."""
    kmap, ptr, idx = _search_tables()
    n = lv.shape[0]
    lv4 = lv.reshape(n * 8, 4)
    code = lv4 @ _LEVEL_WEIGHTS
    off = kmap[code] < 0
    g = np.flatnonzero(off)
    if g.size:
        c = code[g]
        counts = ptr[c + 1] - ptr[c]
        ends = np.cumsum(counts)
        starts = ends - counts
        cand = idx[np.arange(ends[-1]) + np.repeat(ptr[c] - starts, counts)]
        # a group of four float32 is one 16-byte complex128 item: one take moves a group
        src = np.repeat(g, counts)
        diff = _as_groups(np.take(_GRID_ODD.view(np.complex128).ravel(), cand))
        diff *= np.repeat(scale[g // 8], counts)[:, None]
        diff -= _as_groups(np.take(xval.view(np.complex128).ravel(), src))
        t = _as_groups(np.take(waux.view(np.complex128).ravel(), src))
        t *= diff
        t *= diff
        d2 = ((t[:, 0] + t[:, 1]) + t[:, 2]) + t[:, 3]
        hit = np.flatnonzero(d2 == np.repeat(np.minimum.reduceat(d2, starts), counts))
        seg = np.searchsorted(ends, hit, side="right")
        first = hit[np.concatenate([[True], seg[1:] != seg[:-1]])]
        lv4[g] = GRID_LEVEL[cand[first]]
    return off.reshape(n, 8)


def _weighted_sums(wt: np.ndarray, xval: np.ndarray, lv: np.ndarray):
    q = (2 * lv + 1).astype(F32)
    return _seq_sum(wt * xval * q), _seq_sum(wt * q * q)


def _quantize_blocks(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """float32 [nblk, 256] (+ importance [nblk, 256]) -> uint8 [nblk, 98]. All sub-blocks of
    all blocks go through each step together."""
    nblk = x.shape[0]
    n = nblk * NSUB
    if qw is None:
        wt = x * x
    else:
        sigma2 = F32(2) * _seq_sum(x * x) / F32(QK)
        wt = qw * np.sqrt(sigma2[:, None] + x * x)
    xb, wt = x.reshape(n, SUB), wt.reshape(n, SUB)
    waux = np.sqrt(wt)

    # Signs: each group of 8 must hold an even number of negatives. With an odd count, the
    # weight of least weight*x^2 keeps its sign wrong (its magnitude becomes -|x|).
    neg = (xb < 0).reshape(n, 4, 8)
    xval = np.abs(xb)
    odd = np.nonzero(neg.sum(-1) & 1)
    least = (wt * xb * xb).reshape(n, 4, 8).argmin(-1)[odd]
    neg[odd[0], odd[1], least] ^= True
    xval[odd[0], odd[1] * 8 + least] *= F32(-1)
    sign_bits = (neg[..., :7] << np.arange(7)).sum(-1).astype(np.uint32)  # [n, 4]

    vmax = xval.max(1)
    live = vmax >= _GROUP_MAX_EPS
    safe_max = np.where(live, vmax, F32(1))

    # Trial scales around max/15: keep the one with the largest sumqx^2/sumq2.
    best = np.zeros(n, F32)
    scale = safe_max / F32(2 * _KMAXQ - 1)
    lv = np.zeros((n, SUB), np.int32)
    on_grid = np.ones((n, 8), bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        for t in _TRIALS:
            inv = (F32(2 * _KMAXQ - 1) + F32(t) * F32(0.2)) / safe_max
            trial = _levels(xval, inv)
            off = _snap_to_grid(trial, xval, waux, F32(1) / inv)
            sumqx, sumq2 = _weighted_sums(wt, xval, trial)
            better = live & (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / sumq2, scale)
            best = np.where(better, scale * sumqx, best)
            lv[better] = trial[better]
            on_grid[better] = ~off[better]

        # Groups that were snapped to a neighbour are re-snapped at the final scale, then the
        # scale is refitted once.
        redo = np.flatnonzero(live & ~on_grid.all(1) & (scale > 0))
        if redo.size:
            sc = scale[redo]
            again = _levels(xval[redo], F32(1) / sc)
            _snap_to_grid(again, xval[redo], waux[redo], sc)
            keep = np.repeat(on_grid[redo], 4, axis=1)
            fixed = np.where(keep, lv[redo], again)
            lv[redo] = fixed
            sumqx, sumq2 = _weighted_sums(wt[redo], xval[redo], fixed)
            scale[redo] = np.where(sumq2 > 0, sumqx / sumq2, sc)

    flip = scale < 0
    scale = np.abs(scale)
    sign_bits[flip] = ~sign_bits[flip] & 0x7F
    lv[~live] = 0
    sign_bits[~live] = 0
    scale[~live] = 0

    kmap = _search_tables()[0]
    grid_idx = kmap[lv.reshape(n, 8, 4) @ _LEVEL_WEIGHTS]
    assert (grid_idx >= 0).all(), "quantizer left a group off the grid"

    # Super-block: d = max scale / 31 (stored with llama.cpp's 1.0125 fudge), s per sub-block.
    sc8 = scale.reshape(nblk, NSUB)
    d = sc8.max(1) / F32(31)
    nonzero = d > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.rint(F32(0.5) * ((F32(1) / d)[:, None] * sc8 - F32(1)))
    s = np.clip(np.where(nonzero[:, None], s, 0), 0, 15).astype(np.uint32)
    words = (sign_bits.reshape(nblk, NSUB, 4) << _SIGN_SHIFTS).sum(-1, dtype=np.uint32)
    words |= s << np.uint32(28)

    out = np.zeros((nblk, BLOCK_BYTES), np.uint8)
    out[:, :2] = (d * _D_FUDGE).astype("<f2").view(np.uint8).reshape(nblk, 2)
    out[:, 2:_QS_END] = grid_idx.reshape(nblk, QK // 4)
    out[:, _QS_END:] = words.astype("<u4").view(np.uint8).reshape(nblk, 4 * NSUB)
    out[~nonzero, 2:] = 0
    return out


def _mean_square_weight() -> float:
    """E[((0.5+s)/2 * magnitude)^2] for uniform random s and grid index: what a random block
    with d = 1 dequantizes to, squared, on average."""
    s = np.arange(16) + 0.5
    return float(np.mean((s / 2) ** 2) * np.mean(GRID_MAG.astype(np.float64) ** 2))


class IQ3XXS(QuantFormat):
    name = "iq3_xxs"
    ggml_type = int(GGMLQuantizationType.IQ3_XXS)
    block_values = QK
    block_bytes = BLOCK_BYTES
    native = True
    activation = "q8_1"
    kernel_dir = "iq3_xxs"
    dim_multiple = QK
    #: measured 0.0454-0.0455 on Gaussian 2048 x 768 without an importance vector (llama.cpp's
    #: x^2 weighting trades small weights for large ones); 0.033 with a uniform importance vector
    roundtrip_nmse = 0.05
    description = ("GGUF IQ3_XXS, 3.06 bits/weight: experts keep the GGUF's bytes; MMQ on q8_1 "
                   "activations; batched gathers")

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
        words = np.ascontiguousarray(blk[..., _QS_END:]).view("<u4")
        s = (words >> np.uint32(28)).astype(np.uint8)
        masks = SIGN_MASK[(words[..., None] >> _SIGN_SHIFTS) & np.uint32(0x7F)]
        negative = ((masks[..., None] >> _BITS8) & 1).astype(bool).reshape(rows, nb, NSUB, SUB)
        magnitude = GRID_MAG[blk[..., 2:_QS_END]].reshape(rows, nb, NSUB, SUB)
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
        float32 with the C loops' summation order.

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
        out = np.empty((rows * nb, BLOCK_BYTES), np.uint8)
        for lo in range(0, rows * nb, _CHUNK_BLOCKS):
            hi = min(lo + _CHUNK_BLOCKS, rows * nb)
            part = None if qw is None else qw.reshape(nb, QK)[np.arange(lo, hi) % nb]
            out[lo:hi] = _quantize_blocks(x[lo:hi], part)
        return out.reshape(rows, nb * BLOCK_BYTES)

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

    def pack_gguf_experts(self, gate: Any, up: Any, down: Any) -> np.ndarray:
        """IQ3_XXS tensors are copied byte for byte; a tensor of another type is dequantized by
        the gguf package and quantized here, and a line on stderr says which."""
        from gguf.quants import dequantize as gguf_dequantize

        dims = [tuple(int(v) for v in reversed(t.shape)) for t in (gate, up, down)]
        if any(len(dm) != 3 for dm in dims):
            raise GGUFError(f"{self.name}: expert tensors must be 3-D [n_experts, rows, cols]; "
                            + ", ".join(f"{t.name} is {list(dm)}"
                                        for t, dm in zip((gate, up, down), dims)))
        n, ffn, hidden = dims[0]
        want = [(n, ffn, hidden), (n, ffn, hidden), (n, hidden, ffn)]
        for t, dm, w in zip((gate, up, down), dims, want):
            if dm != w:
                raise GGUFError(
                    f"{self.name}: tensor {t.name} has shape {list(dm)} [n_experts, rows, cols]; "
                    f"with {gate.name} {list(dims[0])} it must be {list(w)}")
        self.check_dims(hidden, ffn)
        parts = []
        for t, (_, rows, cols) in zip((gate, up, down), want):
            if int(t.tensor_type) == self.ggml_type:
                parts.append(np.asarray(t.data, dtype=np.uint8).reshape(n, -1))
                continue
            type_name = GGMLQuantizationType(int(t.tensor_type)).name
            per_expert = []
            for e in range(n):
                try:
                    m = np.asarray(gguf_dequantize(t.data[e], t.tensor_type), dtype=F32)
                except (NotImplementedError, ValueError, KeyError) as err:
                    raise FormatError(
                        f"{self.name}: tensor {t.name} has type {type_name}, which is not "
                        f"IQ3_XXS and which the gguf package cannot dequantize ({err})") from None
                per_expert.append(self.quantize(m.reshape(rows, cols)).reshape(-1))
            parts.append(np.stack(per_expert))
        return np.concatenate(parts, axis=1)

    # ------------------------------------------------------------------ device side
    def mmq_reference(self, image: np.ndarray, expert_ids: tuple[int, ...], acts: Any,
                      bounds: np.ndarray, m: int, k: int) -> np.ndarray:
        from .iq3_xxs_device import mmq_reference

        return mmq_reference(self, image, expert_ids, acts, bounds, m, k)

    def kernels_class(self) -> type[FormatKernels]:
        from .iq3_xxs_device import IQ3XXSKernels

        return IQ3XXSKernels

    def mmq_variants(self) -> tuple[str, ...]:
        from .iq3_xxs_device import MMQ_VARIANTS

        return tuple(MMQ_VARIANTS)


@hookimpl
def strata_rt_formats() -> list[QuantFormat]:
    return [IQ3XXS()]
