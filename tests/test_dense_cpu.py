"""Dense projections, RMSNorm and logits without a GPU (strata_rt/backends/cuda/dense/kernels.py,
strata_rt/gemm/cublas.py): the cuBLAS lookup (nothing loaded on import, a clear error naming every
path tried), the RMSNorm twin against a float64 RMSNorm, the launches of the batch-invariant
GEMM path and their argument packing against the PTX. On a GPU: tests/test_dense_gpu.py."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from strata_rt.backends.cuda.dense.kernels import (
    DENSE_SOURCE,
    NORM_THREADS,
    OWN_BOUNDS_BYTES,
    DenseError,
    DenseKernels,
    gemm_reference,
    own_workspace_bytes,
    rmsnorm_f16_reference,
    workspace_bytes,
)
from strata_rt.gemm import cublas
from strata_rt.runtime.compile import nvcc_available
from strata_rt.weights.model import rms_norm


# ------------------------------------------------------------------------------ CPU
def test_import_loads_no_library():
    code = ("import strata_rt.gemm.cublas, strata_rt.backends.cuda.dense.kernels\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('cublas' in maps)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


def test_missing_library_names_every_path_tried(monkeypatch, tmp_path):
    fake = tmp_path / "libcublas.so.13"
    fake.write_bytes(b"not an ELF file")
    tried = ["libcublas_absent_soname.so.99", str(tmp_path / "nowhere" / "libcublas.so.13"),
             str(fake)]
    monkeypatch.setattr(cublas, "candidate_paths", lambda: tried)
    cublas.library.cache_clear()
    try:
        with pytest.raises(cublas.CublasError) as info:
            cublas.library()
    finally:
        cublas.library.cache_clear()
    msg = str(info.value)
    for path in tried:
        assert path in msg
    assert "(absent)" in msg and "LD_LIBRARY_PATH" in msg
    assert isinstance(info.value, cublas.StrataError)


def test_candidate_paths_order(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    paths = cublas.candidate_paths()
    assert paths[: len(cublas.SONAMES)] == list(cublas.SONAMES)
    home = paths.index(str(tmp_path / "home" / "lib64" / "libcublas.so.13"))
    cpath = paths.index(str(tmp_path / "path" / "lib64" / "libcublas.so.12"))
    default = paths.index("/usr/local/cuda/lib64/libcublas.so.13")
    assert len(cublas.SONAMES) <= home < cpath < default
    assert len(paths) == len(set(paths))


class _FakeCublas:
    """Records the calls a Cublas makes; every call succeeds."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            return 0
        return call


class _Stream:
    def __init__(self, handle):
        self.handle = handle


def test_cublas_calls(monkeypatch):
    """Handle setup, the workspace set again after every stream change (cublasSetStream resets
    it), and GemmEx's column-major arguments for row-major out = x . w^T."""
    fake = _FakeCublas()
    monkeypatch.setattr(cublas, "library", lambda: fake)
    owner = type("Owner", (), {"owned": [], "_own": lambda self, o: self.owned.append(o)})()
    cb = cublas.Cublas(0x1000, 4096, owner=owner)
    assert owner.owned == [cb]
    names = [c[0] for c in fake.calls]
    assert names[:4] == ["cublasCreate_v2", "cublasSetWorkspace_v2", "cublasSetPointerMode_v2",
                         "cublasSetMathMode"]
    assert fake.calls[1][2].value == 0x1000 and fake.calls[1][3] == 4096
    assert fake.calls[2][2] == cublas.CUBLAS_POINTER_MODE_HOST
    assert fake.calls[3][2] == cublas.CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION
    fake.calls.clear()
    cb.gemm(_Stream(0xA), x=0x2000, w=0x3000, out=0x4000, rows=7, n_out=512, k=256,
            out_f32=True, accumulate=True)
    assert [c[0] for c in fake.calls] == ["cublasSetStream_v2", "cublasSetWorkspace_v2",
                                          "cublasGemmEx"]
    g = fake.calls[-1]
    (_, _, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc, comp, algo) = g
    assert (ta, tb, m, n, k) == (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, 512, 7, 256)
    assert (a.value, at, lda) == (0x3000, cublas.CUDA_R_16F, 256)  # A = w, k apart
    assert (b.value, bt, ldb) == (0x2000, cublas.CUDA_R_16F, 256)  # B = x, k apart
    assert (c.value, ct, ldc) == (0x4000, cublas.CUDA_R_32F, 512)  # C = out, n_out apart
    assert (comp, algo) == (cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    assert alpha._obj.value == 1.0 and beta._obj.value == 1.0
    fake.calls.clear()
    cb.gemm(_Stream(0xA), 0x2000, 0x3000, 0x4000, 7, 512, 256, out_f32=False, accumulate=False)
    assert [c[0] for c in fake.calls] == ["cublasGemmEx"]  # same stream: nothing reset
    assert fake.calls[0][16] == cublas.CUDA_R_16F and fake.calls[0][14]._obj.value == 0.0
    fake.calls.clear()
    cb.gemm(_Stream(0xB), 0x2000, 0x3000, 0x4000, 7, 512, 256, out_f32=True, accumulate=False)
    assert [c[0] for c in fake.calls] == ["cublasSetStream_v2", "cublasSetWorkspace_v2",
                                          "cublasGemmEx"]
    cb.destroy()
    cb.destroy()  # once only
    assert [c[0] for c in fake.calls].count("cublasDestroy_v2") == 1
    with pytest.raises(cublas.CublasError, match="after destroy"):
        cb.gemm(_Stream(0xB), 0x2000, 0x3000, 0x4000, 7, 512, 256, True, False)


@pytest.mark.parametrize("hidden", [256, 1000, 2048, 4096])
def test_rmsnorm_twin_is_an_rmsnorm(rng, hidden):
    rows = 9
    x = rng.standard_normal((rows, hidden), dtype=np.float32)
    x *= np.logspace(-3, 3, rows, dtype=np.float32)[:, None]
    w = rng.uniform(0.5, 2.0, hidden).astype(np.float32)
    got = rmsnorm_f16_reference(x, w, 1e-6)
    want = rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-6)
    assert got.dtype == np.float16 and got.shape == x.shape
    # one fp16 rounding of a value within a few fp32 ulps of the float64 RMSNorm
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= np.spacing(np.abs(want).astype(np.float16)).astype(np.float64))
    # each row on its own gives the same bytes (the twin, like the kernel, is per row)
    assert np.array_equal(rmsnorm_f16_reference(x[3:4], w, 1e-6), got[3:4])


def test_kernel_threads_match_the_twin():
    m = re.search(r"#define DENSE_NORM_THREADS (\d+)", DENSE_SOURCE.read_text())
    assert m is not None and int(m.group(1)) == NORM_THREADS


def test_gemm_twin_rounds_once(rng):
    x = rng.standard_normal((5, 64)).astype(np.float16)
    w = rng.standard_normal((3, 64)).astype(np.float16)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.array_equal(gemm_reference(x, w), exact.astype(np.float32))
    assert np.array_equal(gemm_reference(x, w, out_f32=False), exact.astype(np.float16))
    base = np.full((5, 3), 1e4, np.float32)
    assert np.array_equal(gemm_reference(x, w, into=base), (exact + 1e4).astype(np.float32))
    with pytest.raises(DenseError, match="float16"):
        gemm_reference(x.astype(np.float32), w)


def test_workspace_sizes_and_choices():
    assert workspace_bytes("cublas", 8192, 9216) == cublas.WORKSPACE_BYTES
    assert workspace_bytes("own", 8192, 9216) == OWN_BOUNDS_BYTES + 4 * 8192 * 9216
    with pytest.raises(DenseError, match="allowed: cublas, own"):
        workspace_bytes("magma", 1, 1)


def _own_on_recorder(nbytes: int | None = None):
    from strata_rt.formats.testing_abi import Recorder

    rec = Recorder()
    nbytes = own_workspace_bytes(64, 512) if nbytes is None else nbytes
    return rec, DenseKernels(rec, 1 << 20, nbytes, gemm_impl="own")  # type: ignore[arg-type]


def test_own_gemm_launches():
    rec, dk = _own_on_recorder()
    ws = 1 << 20
    dk.gemm(None, 2 << 20, 3 << 20, 4 << 20, 64, 512, 256, out_f32=True, accumulate=False)
    assert [launch.name for launch in rec.launches] == ["dense_set_bounds", "gemm_f16_m64"]
    bounds, gemm = rec.launches
    assert bounds.args == (ws, 64)
    assert gemm.args[16:] == (3 << 20, 2 << 20, ws, 4 << 20, 512, 256)  # direct fp32 output
    rec.launches.clear()
    dk.gemm(None, 2 << 20, 3 << 20, 4 << 20, 64, 512, 256, out_f32=True, accumulate=True)
    names = [launch.name for launch in rec.launches]
    assert names == ["dense_set_bounds", "gemm_f16_m64", "dense_epilogue"]
    scratch = ws + OWN_BOUNDS_BYTES
    assert rec.launches[1].args[19] == scratch
    assert rec.launches[2].args == (scratch, 4 << 20, 64 * 512, 1)
    rec.launches.clear()
    dk.gemm(None, 2 << 20, 3 << 20, 4 << 20, 7, 512, 256, out_f32=False, accumulate=False)
    assert rec.launches[1].name == "gemm_f16_m32" and rec.launches[2].args[3] == 0


@pytest.mark.parametrize("change,match", [
    (dict(n_out=500), "multiple of 128"),
    (dict(k=100), "multiple of 64"),
    (dict(rows=65, accumulate=True), "needs a workspace"),
    (dict(out_f32=False, accumulate=True), "fp16 output"),
    (dict(out=(4 << 20) + 4), "out"),
])
def test_own_gemm_refusals(change, match):
    rec, dk = _own_on_recorder()
    args = dict(x=2 << 20, w=3 << 20, out=4 << 20, rows=64, n_out=512, k=256, out_f32=True,
                accumulate=False)
    args.update(change)
    with pytest.raises(Exception, match=match):
        dk.gemm(None, **args)
    assert rec.launches == []


def test_rmsnorm_launch_and_refusals():
    rec, dk = _own_on_recorder()
    dk.rmsnorm_f16(None, 1 << 21, 1 << 22, 1 << 23, 5, 2048, 1e-6, row_stride=4096)
    (launch,) = rec.launches
    assert launch.grid == (5, 1, 1) and launch.block == (NORM_THREADS, 1, 1)
    assert launch.args[:5] == (1 << 21, 1 << 22, 1 << 23, 2048, 4096)
    with pytest.raises(DenseError, match="stride 100"):
        dk.rmsnorm_f16(None, 0, 0, 0, 5, 2048, 1e-6, row_stride=100)
    rec.launches.clear()
    dk.logits(None, 1 << 21, 3, 1 << 22, 1 << 24, 1 << 23, 1 << 25, 2, 256, 512, 1e-6)
    norm = rec.launches[0]
    assert norm.args[0] == (1 << 21) + 4 * 3 * 256 and norm.grid == (2, 1, 1)
    assert rec.launches[2].args[16:] == (1 << 24, 1 << 23, 1 << 20, 1 << 25, 512, 256)


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not available")
def test_argument_types_match_the_kernels():
    from strata_rt.formats.testing_abi import check_params

    rec, _ = _own_on_recorder()
    dense = [p for p in rec.prepared if p.source == DENSE_SOURCE]
    assert {p.name for p in dense} == {"dense_rmsnorm_f16", "dense_set_bounds",
                                       "dense_epilogue"}
    for p in dense:
        for arch in ("sm_80", "sm_90"):
            check_params(p, arch)
