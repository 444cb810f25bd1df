"""Dense projections, RMSNorm and logits on a GPU: both GEMM implementations against float64
products of the same fp16 inputs at the shapes of Qwen3-30B-A3B, Qwen3-235B-A22B and the tiny
model, outputs poisoned with NaN first; accumulate adds exactly once; identical bytes on a
second run and from a captured graph; RMSNorm byte for byte against its twin; logits over the
151,936-token vocabulary; the "own" GEMM's bytes independent of the row count. Without a GPU:
tests/test_dense_cpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from strata_rt.backends.cuda.dense.kernels import (
    GEMM_IMPLS,
    DenseKernels,
    logits_reference,
    rmsnorm_f16_reference,
    workspace_bytes,
)
from strata_rt.formats.numerics import nmse
from strata_rt.gemm import cublas

#: fp32-accumulated GEMM vs float64 on the same fp16 inputs (K <= 8192: the rounding of the
#: fp32 sums stays near 1e-11; a transposed or mis-strided operand gives ~1)
GEMM_NMSE = 1e-8
#: (name, hidden, q_dim, kv_dim): Qwen3-30B-A3B, Qwen3-235B-A22B, configs/tiny-qwen3moe.yaml
SHAPES = [("30b", 2048, 4096, 512), ("235b", 4096, 8192, 512), ("tiny", 256, 256, 128)]
ROWS = [1, 7, 64, 1000, 8192]
VOCAB = 151936
#: rows of a large output checked against float64 (all of them are checked for NaN)
CHECKED_ROWS = 256


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
