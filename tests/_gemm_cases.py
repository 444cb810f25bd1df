"""Device buffers, random grouped-GEMM cases and a poisoned-output runner shared by the tests of
the fp16 GEMMs (tests/test_gemm_f16.py, tests/test_cutlass_gemm.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: a float32 quiet NaN's bits: outputs are filled with it before a launch
NAN_F32 = np.uint32(0x7FC00000)


def _upload(rt, stream, host: np.ndarray):
    buf = rt.alloc(max(host.nbytes, 16))
    if host.nbytes:
        rt.memcpy_htod(buf.ptr, np.ascontiguousarray(host), stream)
    return buf


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
