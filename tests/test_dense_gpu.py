"""Dense projections, RMSNorm and logits (strata_rt/dense_kernels.py, strata_rt/cublas.py).

CPU: the cuBLAS lookup (nothing loaded on import, a clear error naming every path tried), the
RMSNorm twin against a float64 RMSNorm, the launches of the batch-invariant GEMM path and their
argument packing against the PTX. GPU: both GEMM implementations against float64 products of
the same fp16 inputs at the shapes of Qwen3-30B-A3B, Qwen3-235B-A22B and the tiny model, outputs
poisoned with NaN first; accumulate adds exactly once; identical bytes on a second run and from
a captured graph; RMSNorm byte for byte against its twin; logits over the 151,936-token
vocabulary; the "own" GEMM's bytes independent of the row count.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from strata_rt import cublas
from strata_rt.dense_kernels import (
    DENSE_SOURCE,
    GEMM_IMPLS,
    NORM_THREADS,
    OWN_BOUNDS_BYTES,
    DenseError,
    DenseKernels,
    gemm_reference,
    logits_reference,
    own_workspace_bytes,
    rmsnorm_f16_reference,
    workspace_bytes,
)
from strata_rt.model import rms_norm
from strata_rt.runtime.compile import nvcc_available
from strata_rt.testing import nmse

#: fp32-accumulated GEMM vs float64 on the same fp16 inputs (K <= 8192: the rounding of the
#: fp32 sums stays near 1e-11; a transposed or mis-strided operand gives ~1)
GEMM_NMSE = 1e-8
#: (name, hidden, q_dim, kv_dim): Qwen3-30B-A3B, Qwen3-235B-A22B, configs/tiny-qwen3moe.yaml
SHAPES = [("30b", 2048, 4096, 512), ("235b", 4096, 8192, 512), ("tiny", 256, 256, 128)]
ROWS = [1, 7, 64, 1000, 8192]
VOCAB = 151936
#: rows of a large output checked against float64 (all of them are checked for NaN)
CHECKED_ROWS = 256


# ------------------------------------------------------------------------------ CPU
def test_import_loads_no_library():
    code = ("import strata_rt.cublas, strata_rt.dense_kernels\n"
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
    from strata_rt.testing_abi import Recorder

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
    from strata_rt.testing_abi import check_params

    rec, _ = _own_on_recorder()
    dense = [p for p in rec.prepared if p.source == DENSE_SOURCE]
    assert {p.name for p in dense} == {"dense_rmsnorm_f16", "dense_set_bounds",
                                       "dense_epilogue"}
    for p in dense:
        for arch in ("sm_80", "sm_90"):
            check_params(p, arch)


# ------------------------------------------------------------------------------ GPU
class Dev:
    """Upload, download and poison on one stream."""

    def __init__(self, rt):
        self.rt, self.s = rt, rt.stream("dense-test")

    def put(self, host: np.ndarray):
        buf = self.rt.alloc(max(host.nbytes, 16))
        self.rt.memcpy_htod(buf.ptr, np.ascontiguousarray(host), self.s)
        return buf

    def empty(self, nbytes: int, poison: bool = True):
        buf = self.rt.alloc(max(nbytes, 16))
        if poison:  # 0xFF bytes are NaN in fp16 and fp32
            self.rt.memset_d8(buf.ptr, 0xFF, buf.nbytes, self.s)
        return buf

    def get(self, buf, dtype, shape) -> np.ndarray:
        host = np.empty(shape, dtype=dtype)
        self.rt.memcpy_dtoh(host, buf.ptr, self.s)
        self.s.synchronize()
        return host


@pytest.fixture
def make_dense(rt):
    """make_dense(impl, max_rows, max_n_out) -> (DenseKernels, its workspace buffer); the
    cuBLAS handles are destroyed and the workspaces freed when the test ends."""
    made = []

    def make(impl: str, max_rows: int = 8192, max_n_out: int = 9216):
        ws = rt.alloc(workspace_bytes(impl, max_rows, max_n_out))
        dk = DenseKernels(rt, ws.ptr, ws.nbytes, gemm_impl=impl)
        made.append((dk, ws))
        return dk, ws

    yield make
    rt.synchronize()
    for dk, ws in made:
        if dk.cublas is not None:
            dk.cublas.destroy()
        ws.free()


def _sample_rows(rng, rows: int) -> np.ndarray:
    if rows <= CHECKED_ROWS:
        return np.arange(rows)
    picked = rng.choice(rows, CHECKED_ROWS - 2, replace=False)
    return np.unique(np.concatenate([[0, rows - 1], picked]))


def _operands(rng, rows, n_out, k):
    x = rng.standard_normal((rows, k), dtype=np.float32)
    x[rng.integers(rows)] *= 30.0  # an outlier row
    w = rng.standard_normal((n_out, k), dtype=np.float32) * k ** -0.5
    return x.astype(np.float16), w.astype(np.float16)


def _check_f16(got: np.ndarray, want64: np.ndarray, k: int) -> None:
    """Each fp16 output within one fp16 step of the float64 value, plus what fp32 accumulation
    may add: at most one fp32 rounding per sequential k16 step, each at the size of the row's
    partial sums (a worst case linear in k: tensor cores round their fp32 adds the same way
    every step, so the errors need not cancel as random ones would; sqrt(k) scaling missed
    one output in 600,000 at k = 4,096)."""
    err = np.abs(got.astype(np.float64) - want64)
    step = np.spacing(np.abs(want64).astype(np.float16)).astype(np.float64)
    row_rms = np.sqrt(np.mean(want64 ** 2, axis=1, keepdims=True))
    allowed = step + 4 * 2.0 ** -24 * (k / 16) * row_rms
    assert np.all(err <= allowed), f"{int(np.sum(err > allowed))} fp16 outputs off by more"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GEMM_IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("rows", ROWS)
def test_gpu_projections(rt, make_dense, rng, impl, shape, rows):
    """qkv (fp16 out), o (accumulated into fp32 x) and a plain fp32 output, twice each."""
    _, hidden, q_dim, kv_dim = shape
    dk, _ = make_dense(impl)
    d = Dev(rt)
    n_qkv = q_dim + 2 * kv_dim
    xa, wqkv = _operands(rng, rows, n_qkv, hidden)
    o, wo = _operands(rng, rows, hidden, q_dim)
    x0 = (rng.standard_normal((rows, hidden), dtype=np.float32) * 4.0)
    b_xa, b_wqkv, b_o, b_wo = d.put(xa), d.put(wqkv), d.put(o), d.put(wo)
    b_qkv = d.empty(rows * n_qkv * 2)
    b_qkv32 = d.empty(rows * n_qkv * 4)
    b_x = d.put(x0)
    runs = []
    for _ in range(2):
        d.rt.memcpy_htod(b_x.ptr, x0, d.s)
        dk.gemm(d.s, b_xa.ptr, b_wqkv.ptr, b_qkv.ptr, rows, n_qkv, hidden, False, False)
        dk.gemm(d.s, b_xa.ptr, b_wqkv.ptr, b_qkv32.ptr, rows, n_qkv, hidden, True, False)
        dk.gemm(d.s, b_o.ptr, b_wo.ptr, b_x.ptr, rows, hidden, q_dim, True, True)
        runs.append((d.get(b_qkv, np.float16, (rows, n_qkv)),
                     d.get(b_qkv32, np.float32, (rows, n_qkv)),
                     d.get(b_x, np.float32, (rows, hidden))))
    for a, b in zip(*runs):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), "second run differs"
    qkv16, qkv32, x1 = runs[0]
    assert not np.isnan(qkv16).any() and not np.isnan(qkv32).any() and not np.isnan(x1).any()
    r = _sample_rows(rng, rows)
    want = xa[r].astype(np.float64) @ wqkv.astype(np.float64).T
    assert nmse(qkv32[r], want) <= GEMM_NMSE
    _check_f16(qkv16[r], want, hidden)
    prod = o[r].astype(np.float64) @ wo.astype(np.float64).T
    # once: x1 - x0 is the product (twice, or not at all, would leave an error the size of x0
    # or of the product, NMSE ~1)
    assert nmse(x1[r], x0[r].astype(np.float64) + prod) <= GEMM_NMSE
    assert nmse(x1[r].astype(np.float64) - x0[r], prod) <= 1e-6


@pytest.mark.gpu
def test_gpu_own_gemm_is_batch_invariant(rt, make_dense, rng):
    """A row's bytes do not depend on how many rows the call has nor where the row sits."""
    dk, _ = make_dense("own")
    d = Dev(rt)
    rows, n_out, k = 1000, 5120, 2048
    x, w = _operands(rng, rows, n_out, k)
    b_x, b_w = d.put(x), d.put(w)
    b_all, b_part = d.empty(rows * n_out * 2), d.empty(rows * n_out * 2)
    dk.gemm(d.s, b_x.ptr, b_w.ptr, b_all.ptr, rows, n_out, k, False, False)
    whole = d.get(b_all, np.uint16, (rows, n_out))
    for first, count in ((0, 1), (999, 1), (3, 7), (100, 160), (200, 800)):
        rt.memset_d8(b_part.ptr, 0xFF, b_part.nbytes, d.s)
        dk.gemm(d.s, b_x.ptr + first * k * 2, b_w.ptr, b_part.ptr, count, n_out, k, False,
                False)
        part = d.get(b_part, np.uint16, (rows, n_out))[:count]
        assert np.array_equal(part, whole[first: first + count]), (first, count)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GEMM_IMPLS)
def test_gpu_gemm_in_a_captured_graph(rt, make_dense, rng, impl):
    """The workspace is the caller's, so a GEMM captures into a CUDA graph and replays the
    eager bytes."""
    dk, _ = make_dense(impl)
    d = Dev(rt)
    rows, n_out, k = 64, 2048, 4096
    x, w = _operands(rng, rows, n_out, k)
    x0 = rng.standard_normal((rows, n_out), dtype=np.float32)
    b_x, b_w, b_out = d.put(x), d.put(w), d.put(x0)
    dk.gemm(d.s, b_x.ptr, b_w.ptr, b_out.ptr, rows, n_out, k, True, True)
    eager = d.get(b_out, np.float32, (rows, n_out))
    d.rt.memcpy_htod(b_out.ptr, x0, d.s)
    d.s.synchronize()
    with rt.capture(d.s) as graph:
        dk.gemm(d.s, b_x.ptr, b_w.ptr, b_out.ptr, rows, n_out, k, True, True)
    graph.launch(d.s)
    assert np.array_equal(d.get(b_out, np.float32, (rows, n_out)).view(np.uint32),
                          eager.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [256, 1000, 2048, 4096])
@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_gpu_rmsnorm_bytes(rt, make_dense, rng, hidden, rows):
    dk, _ = make_dense("own", 1, 128)
    d = Dev(rt)
    stride = hidden + 64
    x = rng.standard_normal((rows, stride), dtype=np.float32)
    x *= np.logspace(-4, 4, rows, dtype=np.float32)[:, None]
    x[0, :hidden] = 0.0  # a zero row: 1 / sqrt(eps)
    w = rng.uniform(-2.0, 2.0, hidden).astype(np.float32)
    b_x, b_w = d.put(x), d.put(w)
    outs = []
    for row_stride in (stride, None):
        src = b_x if row_stride is not None else d.put(np.ascontiguousarray(x[:, :hidden]))
        b_out = d.empty(rows * hidden * 2)
        dk.rmsnorm_f16(d.s, src.ptr, b_w.ptr, b_out.ptr, rows, hidden, 1e-6, row_stride)
        outs.append(d.get(b_out, np.uint16, (rows, hidden)))
    want = rmsnorm_f16_reference(x[:, :hidden], w, 1e-6).view(np.uint16)
    for got in outs:
        bad = np.argwhere(got != want)
        assert bad.size == 0, f"{len(bad)} values differ from the twin, first at {bad[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 4096])
@pytest.mark.parametrize("tokens,first_row,rows", [(37, 36, 1), (100, 5, 64)])
def test_gpu_logits(rt, make_dense, rng, hidden, tokens, first_row, rows):
    """The last position (rows 1) and a block of positions (rows 64) of a chunk, over the
    151,936-token vocabulary, both GEMM implementations against one float64 reference."""
    d = Dev(rt)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32) * 3.0
    norm_w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    w_out = (rng.standard_normal((VOCAB, hidden), dtype=np.float32) * 0.05).astype(np.float16)
    b_x, b_n, b_w = d.put(x), d.put(norm_w), d.put(w_out)
    want_y = rmsnorm_f16_reference(x[first_row: first_row + rows], norm_w, 1e-6)
    want = logits_reference(x, first_row, rows, norm_w, w_out, 1e-6)
    for impl in GEMM_IMPLS:
        dk, _ = make_dense(impl, 1, 128)  # logits are written directly: no scratch
        b_y, b_out = d.empty(rows * hidden * 2), d.empty(rows * VOCAB * 4)
        dk.logits(d.s, b_x.ptr, first_row, b_n.ptr, b_w.ptr, b_y.ptr, b_out.ptr, rows, hidden,
                  VOCAB, 1e-6)
        got = d.get(b_out, np.float32, (rows, VOCAB))
        y = d.get(b_y, np.uint16, (rows, hidden))
        assert np.array_equal(y, want_y.view(np.uint16)), impl
        assert not np.isnan(got).any(), impl
        assert nmse(got, want) <= GEMM_NMSE, impl
        assert np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)) >= 0.99, impl


@pytest.mark.gpu
def test_gpu_cublas_version_and_refusals(rt, make_dense):
    dk, ws = make_dense("cublas")
    assert dk.cublas is not None and dk.cublas.version >= (12, 0, 0)
    s = rt.stream("dense-test")
    with pytest.raises(cublas.CublasError, match="fp16 output"):
        dk.gemm(s, 0, 0, 0, 4, 128, 64, out_f32=False, accumulate=True)
    with pytest.raises(cublas.CublasError, match="positive"):
        dk.gemm(s, 0, 0, 0, 0, 128, 64, out_f32=True, accumulate=False)
    with pytest.raises(cublas.CublasError, match="256-byte"):
        cublas.Cublas(ws.ptr + 16, 1 << 20)
