"""IQ3_XXS on the GPU: the MMQ launchers (kernels/iq3_xxs/mmq.cu) and the numpy mirror of their
arithmetic.

The arithmetic contract, identical for every variant and for `mmq_reference`, per output
(activation row r, weight row i), over the 32-value sub-blocks j of K in ascending order:

    idot  = sum of q_w * q_a                 (int, exact)
    rint  = (2*s_ij + 1) * idot              (int, exact, |rint| < 2^23)
    scale = fl(dq_i * da_rj)                 (dq = fp16 d * 0.25, exact; da = q8_1 scale)
    acc   = fl(acc + fl(scale * rint))       (float32, round to nearest, no FMA)

so the kernels and the reference agree to the last bit (tests compare bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from strata_rt import env
from strata_rt.activations import Q8_1Acts
from strata_rt.errors import FormatError
from strata_rt.formats import KERNELS_ROOT, MMQ_GROUP, ExpertLayout, QuantFormat
from strata_rt.native_gather import NativeKernels

if TYPE_CHECKING:
    from strata_rt.runtime import Runtime

#: MMQ kernels, fastest measured first (the default when STRATA_MMQ_KERNEL is unset), and the
#: activation-row tile sizes (TM in mmq.cu) each is compiled for. H200 (bench/notes.md, run 5):
#: f16_pipe is the fastest or tied from 2,048 tokens (37 / 85 / 119 TFLOPS per layer at 512 /
#: 2,048 / 8,192 tokens); int8_occ2 (two blocks per SM) is faster at 512 tokens (41); f16 and int8
#: are the unpipelined designs (int8: the llama.cpp-style integer reference path). All are
#: bit-identical, so the choice changes speed only.
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
#: rows of activations the reference multiplies at once (bounds its float64 scratch)
_REF_CHUNK = 128


def pick_variant(name: str | None = None) -> str:
    """The MMQ variant to run: `name`, else STRATA_MMQ_KERNEL, else the fastest measured."""
    chosen = name or env.text("STRATA_MMQ_KERNEL") or MMQ_VARIANTS[0]
    if chosen not in MMQ_VARIANTS:
        raise FormatError(f"IQ3_XXS MMQ variant {chosen!r} (STRATA_MMQ_KERNEL) is unknown; "
                          f"valid: {', '.join(MMQ_VARIANTS)}")
    return chosen


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
    """Gathers (from NativeKernels) plus the grouped MMQ of one variant."""

    def __init__(self, fmt: QuantFormat, runtime: Runtime, layout: ExpertLayout,
                 variant: str | None = None):
        super().__init__(fmt, runtime, layout)
        self.variant = pick_variant(variant)
        mod = runtime.module(MMQ_SOURCE)
        self._mmq = {tm: mod.kernel(f"iq3_mmq_{self.variant}_m{tm}", "i" * MMQ_GROUP + "PPPPii")
                     for tm in MMQ_TILES[self.variant]}

    def mmq(self, stream, weights: int, expert_ids: tuple[int, ...], acts: int, bounds: int,
            out: int, m: int, k: int, rows_hint: int) -> None:
        n = len(expert_ids)
        if not 1 <= n <= MMQ_GROUP:
            raise FormatError(f"IQ3_XXS MMQ over {n} experts: a group holds 1..{MMQ_GROUP}")
        if m % MMQ_TILE_W or k % 256 or m <= 0 or k <= 0:
            raise FormatError(f"IQ3_XXS MMQ needs m % {MMQ_TILE_W} == 0 and k % 256 == 0; "
                              f"got m={m}, k={k}")
        tm = tile_rows_for(self.variant, rows_hint)
        ids = [int(e) for e in expert_ids] + [-1] * (MMQ_GROUP - n)
        self._mmq[tm].launch(
            grid=(m // MMQ_TILE_W, n, max(1, -(-rows_hint // tm))), block=(MMQ_THREADS, 1, 1),
            stream=stream, args=(*ids, weights, acts, bounds, out, m, k),
            shared=mmq_smem_bytes(self.variant, tm))


def mmq_reference(fmt: QuantFormat, image: np.ndarray, expert_ids: tuple[int, ...],
                  acts: Q8_1Acts, bounds: np.ndarray, m: int, k: int) -> np.ndarray:
    """numpy mirror of the MMQ kernels, bit for bit (see the module docstring).

    Integer dots are exact float64 products of small integers (BLAS-fast, |sum| < 2^53); the
    float32 accumulation then runs over the sub-blocks in ascending order, as in the kernel.
    `fmt.decode(raw, shape)` supplies d, the sub-block scales s and the signed magnitudes q."""
    rows = acts.q.shape[0]
    if acts.q.shape[1] != k:
        raise FormatError(f"activations hold K={acts.q.shape[1]} values per row; the MMQ has k={k}")
    out = np.zeros((rows, m), dtype=np.float32)
    nsub = k // 32
    img = np.asarray(image, dtype=np.uint8).reshape(len(expert_ids), -1)
    for p, e in enumerate(expert_ids):
        if e < 0:
            continue
        r0, r1 = int(bounds[e]), int(bounds[e + 1])
        if r1 <= r0:
            continue
        d, s, q = fmt.decode(img[p], (m, k))
        dq = (np.asarray(d, dtype=np.float32) * np.float32(0.25)).repeat(8, axis=1)  # [m, nsub]
        s21 = (2.0 * np.asarray(s, dtype=np.float64) + 1.0).reshape(m, nsub)
        wq = np.asarray(q, dtype=np.float64).reshape(m, nsub, 32).transpose(1, 2, 0)
        for c0 in range(r0, r1, _REF_CHUNK):
            c1 = min(r1, c0 + _REF_CHUNK)
            aq = acts.q[c0:c1].astype(np.float64).reshape(c1 - c0, nsub, 32).transpose(1, 0, 2)
            idot = np.matmul(aq, wq)                                   # [nsub, rows, m]
            rint = (idot * s21.T[:, None, :]).astype(np.float32)       # exact integers
            da = acts.d[c0:c1]
            acc = np.zeros((c1 - c0, m), dtype=np.float32)
            for j in range(nsub):
                scale = dq[None, :, j] * da[:, j, None]
                acc = acc + scale * rint[j]
            out[c0:c1] = acc
    return out
