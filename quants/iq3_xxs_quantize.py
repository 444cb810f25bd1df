"""The IQ3_XXS quantizer: llama.cpp's reference search (quantize_row_iq3_xxs_impl, 256-point
grid), vectorized over all sub-blocks of many blocks at once. `IQ3XXS.quantize` documents what
it matches and where it can differ; this module holds the block geometry, the grid tables the
search and the decoder share, and the search itself.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .iq3_xxs_grid import GRID, LEVELS

F32 = np.float32
QK = 256  # weights per block
SUB = 32  # weights per sub-block (one scale, one sign word)
NSUB = QK // SUB
BLOCK_BYTES = 98
QS_END = 2 + QK // 4  # grid indices occupy bytes 2..65, sign/scale words 66..97

_GRID_U32 = np.array(GRID, dtype=np.uint32)
#: [256, 4] magnitudes of each grid point (byte j of the packed entry)
GRID_MAG = ((_GRID_U32[:, None] >> np.array([0, 8, 16, 24], np.uint32)) & 0xFF).astype(np.uint8)
#: [256, 4] level codes 0..7 of each grid point (index into LEVELS)
GRID_LEVEL = np.searchsorted(np.array(LEVELS), GRID_MAG).astype(np.int32)
#: [256, 4] the odd integers 2l+1 the quantizer's search measures grid points in
_GRID_ODD = (2 * GRID_LEVEL + 1).astype(F32)
SIGN_SHIFTS = np.array([0, 7, 14, 21], dtype=np.uint32)
_LEVEL_SHIFTS = np.array([0, 3, 6, 9], dtype=np.int32)
#: packs a group's four level codes into one 12-bit code l0 | l1<<3 | l2<<6 | l3<<9
_LEVEL_WEIGHTS = np.array([1, 8, 64, 512], dtype=np.int32)

# llama.cpp's constants for IQ3_XXS: 8 levels (quantizer works with odd integers 2l+1), the 31
# trial scales, the all-zero threshold of a sub-block and the fudge factor applied to d.
_KMAXQ = 8
_TRIALS = range(-15, 16)
_GROUP_MAX_EPS = F32(1e-8)
_D_FUDGE = F32(1.0125)
CHUNK_BLOCKS = 4096  # blocks quantized per numpy pass (bounds temporary memory)


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


def quantize_blocks(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
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
    words = (sign_bits.reshape(nblk, NSUB, 4) << SIGN_SHIFTS).sum(-1, dtype=np.uint32)
    words |= s << np.uint32(28)

    out = np.zeros((nblk, BLOCK_BYTES), np.uint8)
    out[:, :2] = (d * _D_FUDGE).astype("<f2").view(np.uint8).reshape(nblk, 2)
    out[:, 2:QS_END] = grid_idx.reshape(nblk, QK // 4)
    out[:, QS_END:] = words.astype("<u4").view(np.uint8).reshape(nblk, 4 * NSUB)
    out[~nonzero, 2:] = 0
    return out
