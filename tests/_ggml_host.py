"""The GGML decoders as host code: kernels/ggml/host_decode.cu built by nvcc into a shared
library (no device needed) and loaded with ctypes; or a plugin's own source (one
STRATA_GGML_KERNELS line over its decoder struct) built the same way with -DSTRATA_GGML_HOST,
which turns that line into host exports of the decoder and the fused tiles' geometry
(kernels/ggml/templates.cuh).

The build is cached under strata_rt's kernel cache (STRATA_KERNEL_CACHE, else
~/.cache/strata_rt/kernels), keyed by a digest of every source in kernels/ggml, the flags and
nvcc's version, so a rerun loads it without compiling and an edited header rebuilds it.
-ffp-contract=off keeps the host compiler from fusing a*b+c (the decoders' host arithmetic is
plain expressions; the reference rounds each operation).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from strata_rt.formats.ggml_types import GgmlType
from strata_rt.resources import KERNELS_ROOT
from strata_rt.runtime.compile import cache_dir, nvcc_path, nvcc_version

SOURCE_DIR = KERNELS_ROOT / "ggml"
HARNESS = SOURCE_DIR / "host_decode.cu"
FLAGS = ("-shared", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off", "-O2",
         "-std=c++17")


#: what a plugin's source is built with: its STRATA_GGML_KERNELS line becomes host exports
PLUGIN_FLAGS = ("-DSTRATA_GGML_HOST",)


def digest(nvcc: str, source: Path = HARNESS, flags: tuple[str, ...] = FLAGS) -> str:
    """sha256 over the sources' names and bytes (kernels/ggml and `source`), the flags and
    the compiler's version."""
    h = hashlib.sha256()
    for path in [*sorted(SOURCE_DIR.iterdir()), source]:
        if path.suffix in (".cu", ".cuh"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(flags).encode() + b"\0" + nvcc_version(nvcc).encode())
    return h.hexdigest()


def build(source: Path = HARNESS, extra_flags: tuple[str, ...] = ()) -> Path:
    """The cached library's path, compiling it first when no build of these sources exists."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    flags = (*FLAGS, *extra_flags)
    target = cache_dir() / f"lib{source.stem}_host-{digest(nvcc, source, flags)[:24]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [nvcc, *flags, "-I", str(SOURCE_DIR), "-I", str(KERNELS_ROOT), "-o", tmp,
               str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{done.stdout}{done.stderr}\n{' '.join(cmd)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class HostDecoder:
    """ctypes front of a host library: decode(t, raw), rows(t, table, ids, cols) and the
    compiled traits (the built-in harness), decode_suffix and fused_geometry (any build's STRATA_GGML_KERNELS exports)."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        if not hasattr(self.lib, "ggml_host_decode"):
            return  # a plugin's build: only the per-decoder exports
        self.lib.ggml_host_decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                              ctypes.c_void_p]
        self.lib.ggml_host_decode.restype = ctypes.c_int
        self.lib.ggml_host_decode_chunks.argtypes = self.lib.ggml_host_decode.argtypes
        self.lib.ggml_host_decode_chunks.restype = ctypes.c_int
        self.lib.ggml_host_traits.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3
        self.lib.ggml_host_traits.restype = ctypes.c_int
        self.lib.ggml_host_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                            ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_void_p]
        self.lib.ggml_host_rows.restype = ctypes.c_int

    def decode(self, t: GgmlType, raw: np.ndarray, chunks: bool = False) -> np.ndarray:
        """float32 values of whole blocks of t (raw: uint8, any shape), pair by pair
        (pair_at) or, with `chunks`, 8 values per step as the gather decodes (chunk8_at)."""
        src = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        n = src.size // t.block_bytes * t.block_values
        out = np.empty(n, dtype=np.float32)
        fn = self.lib.ggml_host_decode_chunks if chunks else self.lib.ggml_host_decode
        rc = fn(t.type_id, src.ctypes.data, n, out.ctypes.data)
        if rc != 0:
            raise ValueError(f"{fn.__name__}({t.name}, {n} values) returned {rc}")
        return out

    def rows(self, t: GgmlType, table: np.ndarray, ids: np.ndarray, cols: int) -> np.ndarray:
        """float32 [len(ids), cols]: rows `ids` of the [vocab, cols] matrix `table` (raw rows
        of t, uint8 [vocab, row bytes]) as the row gather walks them (kernels/ggml/rows.cuh:
        NaN for an id outside the matrix)."""
        src = np.ascontiguousarray(table, dtype=np.uint8)
        vocab, row_bytes = src.shape
        ids32 = np.ascontiguousarray(ids, dtype=np.int32)
        out = np.empty((ids32.size, cols), dtype=np.float32)
        rc = self.lib.ggml_host_rows(t.type_id, src.ctypes.data, row_bytes, vocab,
                                     ids32.ctypes.data, ids32.size, cols, out.ctypes.data)
        if rc != 0:
            raise ValueError(f"ggml_host_rows({t.name}, {ids32.size} ids of {cols}) returned {rc}")
        return out

    def decode_suffix(self, suffix: str, block_values: int, block_bytes: int, raw: np.ndarray,
                      chunks: bool = False) -> np.ndarray:
        """decode through the exports of a STRATA_GGML_KERNELS(suffix, ...) line."""
        src = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        n = src.size // block_bytes * block_values
        out = np.empty(n, dtype=np.float32)
        fn = getattr(self.lib, f"ggml_host_decode_{'chunks_' if chunks else ''}{suffix}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        rc = fn(src.ctypes.data, n, out.ctypes.data)
        if rc != 0:
            raise ValueError(f"{fn.__name__}({n} values) returned {rc}")
        return out

    def fused_geometry(self, suffix: str) -> list[tuple[int, ...]]:
        """Per fused tile, in list order, as the compiled templates size it: (block values,
        block bytes, stage values, stage bytes, shared weight row, stages, dynamic smem)."""
        fn = getattr(self.lib, f"ggml_host_fused_{suffix}")
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        fn.restype = ctypes.c_int
        rows: list[tuple[int, ...]] = []
        geo = (ctypes.c_int * 7)()
        while fn(len(rows), geo) == 0:
            rows.append(tuple(geo))
        return rows

    def traits(self) -> list[tuple[int, int, int]]:
        """(type id, values per block, bytes per block) of every compiled type, in order."""
        rows: list[tuple[int, int, int]] = []
        cells = [ctypes.c_int() for _ in range(3)]
        while self.lib.ggml_host_traits(len(rows), *(ctypes.byref(c) for c in cells)) == 0:
            rows.append((cells[0].value, cells[1].value, cells[2].value))
        return rows


@functools.lru_cache(maxsize=1)
def host_decoder() -> HostDecoder:
    return HostDecoder(build())


@functools.lru_cache(maxsize=4)
def plugin_decoder(source: Path) -> HostDecoder:
    """The host build of a plugin's source (its decoder and its tiles' geometry)."""
    return HostDecoder(build(Path(source), PLUGIN_FLAGS))
