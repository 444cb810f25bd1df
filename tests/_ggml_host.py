"""The GGML decoders as host code: kernels/ggml/host_decode.cu built by nvcc into a shared
library (no device needed) and loaded with ctypes.

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


def digest(nvcc: str) -> str:
    """sha256 over the sources' names and bytes, the flags and the compiler's version."""
    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join(FLAGS).encode() + b"\0" + nvcc_version(nvcc).encode())
    return h.hexdigest()


def build() -> Path:
    """The cached library's path, compiling it first when no build of these sources exists."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    target = cache_dir() / f"libggml_host_decode-{digest(nvcc)[:24]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [nvcc, *FLAGS, "-I", str(SOURCE_DIR), "-o", tmp, str(HARNESS)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{done.stdout}{done.stderr}\n{' '.join(cmd)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class HostDecoder:
    """ctypes front of the host library: decode(t, raw) and the compiled traits."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.ggml_host_decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                              ctypes.c_void_p]
        self.lib.ggml_host_decode.restype = ctypes.c_int
        self.lib.ggml_host_decode_chunks.argtypes = self.lib.ggml_host_decode.argtypes
        self.lib.ggml_host_decode_chunks.restype = ctypes.c_int
        self.lib.ggml_host_traits.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 3
        self.lib.ggml_host_traits.restype = ctypes.c_int

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
