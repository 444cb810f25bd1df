"""Device buffers, random grouped-GEMM cases, a poisoned-output runner and the launch-check and
register-budget helpers shared by the tests of the GEMMs (tests/test_gemm_f16.py,
tests/test_cutlass_gemm.py, tests/test_fused_gemm.py)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from _format_harness import NAN_BITS as NAN_F32
from _format_harness import upload as _upload

from strata_rt.errors import FormatError
from strata_rt.resources import KERNELS_ROOT
from strata_rt.runtime.compile import nvcc_path

__all__ = ["GEMM_ARGS", "GEMM_CASES", "NAN_F32", "GemmCase", "_download", "_upload",
           "assert_fits_registers", "assert_refused", "make_gemm_case", "run_gemm"]

#: one valid launch under the MMQ contract; the argument-check tests change one field of it
GEMM_ARGS = dict(weights=4096, expert_ids=(0, 1), acts=8192, bounds=12288, out=16384, m=1536,
                 k=2048, rows_hint=64, tile=None)


def assert_fits_registers(source: Path, arch: str, tiles_by_name: dict, out_dir: Path,
                          extra: tuple[str, ...] = ()) -> None:
    """ptxas -v on `source` for `arch` (with `extra` nvcc arguments, e.g. defines): every
    kernel is a tile of tiles_by_name (each with threads and min_blocks), none spills, and
    min_blocks blocks fit the SM's 64K registers."""
    out = subprocess.run(
        [str(nvcc_path()), "-cubin", "-O3", "-std=c++17", f"-arch={arch}", "-I",
         str(KERNELS_ROOT), *extra, "-Xptxas", "-v", "-o",
         str(out_dir / f"{source.stem}.cubin"), str(source)],
        capture_output=True, text=True, check=True).stderr
    found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes "
                       r"spill loads.*?Used (\d+) registers", out, re.S)
    assert {name for name, *_ in found} == set(tiles_by_name)
    for name, stores, loads, regs in found:
        t = tiles_by_name[name]
        print(f"{arch} {name}: {regs} registers, spills {stores}/{loads} bytes")
        assert int(stores) == int(loads) == 0, name
        assert int(regs) * t.threads * t.min_blocks <= 65536, name


def assert_refused(gemm, kernels: dict, change: dict, match: str) -> None:
    """GEMM_ARGS with `change` applied: gemm.gemm raises a FormatError naming `match` and
    launches none of `kernels` (recording kernels)."""
    with pytest.raises(FormatError, match=re.escape(match)):
        gemm.gemm(None, **{**GEMM_ARGS, **change})
    assert not any(k.calls for k in kernels.values())

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
