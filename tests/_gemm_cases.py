"""Device buffers, random grouped-GEMM cases and a poisoned-output runner shared by the tests of
the fp16 GEMMs (tests/test_gemm_f16.py, tests/test_cutlass_gemm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from _format_harness import NAN_BITS as NAN_F32
from _format_harness import upload as _upload

__all__ = ["GEMM_CASES", "NAN_F32", "GemmCase", "_download", "_upload", "make_gemm_case",
           "run_gemm"]

#: (m, k, rows of each of the layer's experts, the group's expert ids): both geometries' gate/up
#: (m = 2*ffn, k = hidden) and down (m = hidden, k = ffn) shapes; 0, 1, odd and tile-straddling
#: row counts; a full group of 16; one expert holding every row; experts outside the group;
#: a group of one; nothing to do (output untouched)
GEMM_CASES = [
    (1536, 2048, [0, 1, 7, 33, 64, 65, 127, 129, 255, 3, 0, 300, 2, 31, 96, 160, 5],
     tuple(range(16))),
    (2048, 768, [5, 0, 1, 70, 3, 129, 0, 17], (0, 1, 2, 3, 5, 7)),
    (3072, 4096, [0, 200, 1, 0, 61], (1, 2, 4)),
    (4096, 1536, [9, 0, 131, 1, 513], (0, 1, 2, 3, 4)),
    (1536, 2048, [0, 0, 1100, 0, 0, 0], (0, 1, 2, 3, 4)),
    (2048, 768, [4, 1000, 4], (1,)),
    (256, 128, [0, 0, 0], (0, 1, 2)),
]


def _download(rt, stream, ptr: int, nbytes: int) -> np.ndarray:
    host = np.empty(nbytes, dtype=np.uint8)
    rt.memcpy_dtoh(host, ptr, stream)
    stream.synchronize()
    return host


@dataclass
class GemmCase:
    images: np.ndarray   # float16 [n, m, k]
    x: np.ndarray        # float16 [rows, k], sorted by expert
    bounds: np.ndarray   # int32 [layer experts + 1]
    ids: tuple[int, ...]

    @property
    def m(self) -> int:
        return self.images.shape[1]

    @property
    def k(self) -> int:
        return self.images.shape[2]

    def rows_of_group(self) -> np.ndarray:
        mask = np.zeros(self.x.shape[0], bool)
        for e in self.ids:
            mask[self.bounds[e]: self.bounds[e + 1]] = True
        return mask

    def max_rows(self) -> int:
        return int(max(self.bounds[e + 1] - self.bounds[e] for e in self.ids))


def make_gemm_case(rng, m: int, k: int, counts: list[int], ids: tuple[int, ...]) -> GemmCase:
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    images = (rng.standard_normal((len(ids), m, k), dtype=np.float32) * k ** -0.5)
    x = rng.standard_normal((int(bounds[-1]), k), dtype=np.float32)
    if x.shape[0]:
        x[rng.integers(x.shape[0])] *= 40.0  # an outlier row
    return GemmCase(images.astype(np.float16), x.astype(np.float16), bounds, ids)


def run_gemm(rt, gg, case: GemmCase, rows_hints: list[int],
             tiles: list[str | None]) -> list[np.ndarray]:
    """One launch per (rows_hint, tile), each on an output poisoned with NaN; raw uint32 outs."""
    s = rt.stream("test")
    rows = case.x.shape[0]
    bufs = [_upload(rt, s, a) for a in (case.images, case.x, case.bounds)]
    out = rt.alloc(max(rows, 1) * case.m * 4)
    outs = []
    try:
        for hint in rows_hints:
            for tile in tiles:
                poison = np.full(max(rows, 1) * case.m, NAN_F32)
                rt.memcpy_htod(out.ptr, poison, s)
                gg.gemm(s, bufs[0].ptr, case.ids, bufs[1].ptr, bufs[2].ptr, out.ptr, case.m,
                        case.k, hint, tile=tile)
                raw = _download(rt, s, out.ptr, out.nbytes).view(np.uint32)
                outs.append(raw.reshape(max(rows, 1), case.m)[:rows])
    finally:
        for b in [*bufs, out]:
            b.free()
    return outs
