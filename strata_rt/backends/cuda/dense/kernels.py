"""The dense part of a Qwen3-MoE layer on the GPU: RMSNorm of the float32 residual into fp16
GEMM operands, the projections (q/k/v, o) and the output head, with numpy twins.

Precision (the wave-2 dataflow): fp16 weights and activations into tensor cores, fp32
accumulation, the residual stream x float32. A projection writes fp16 (q/k/v, the next kernel's
input) or adds its fp32 result into x (the o projection) or writes fp32 (logits).

Two GEMM implementations, same contract (`gemm_impl`: EngineConfig.dense_gemm, STRATA_DENSE_GEMM):
- "cublas" (default): cublasGemmEx, fastest; the same bytes run after run, but a row's bytes
  may change with the number of rows in the call (cuBLAS picks kernels and split-K by shape),
  so prefilling a prompt in other chunk sizes can change the logits in the last bits.
- "own": the project's grouped fp16 GEMM (strata_rt.gemm.grouped_gemm) with the whole chunk as one
  "expert". Each output is one fp32 accumulator over K in ascending order whatever the tile and
  the row count, so it is batch-invariant: a row's bytes depend on that row and the weights
  only, and chunking is byte-exact. It needs n_out % 128 == 0 and k % 64 == 0, and a workspace
  of 256 + 4 * rows * n_out bytes for fp16 or accumulated outputs (own_workspace_bytes).

RMSNorm order (dense.cu, reproduced exactly by rmsnorm_f16_reference): per row, thread t of
256 adds the fp32-rounded squares of columns t, t+256, ... in ascending order from 0; the 256
partial sums are combined by a butterfly (xor 16, 8, 4, 2, 1) inside each warp of 32 and the
same butterfly over the 8 warp sums padded with zeros; then inv = 1 / sqrt(ss / hidden + eps)
and out = fp16((x * inv) * w), every operation rounded to nearest in fp32.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ....errors import StrataError
from ....formats.launchers import check_aligned
from ....gemm.cublas import WORKSPACE_BYTES, Cublas
from ....gemm.grouped_gemm import K_MULTIPLE, TILE_N, GroupedGemm
from ....resources import KERNELS_ROOT

if TYPE_CHECKING:
    from ....runtime import Runtime, Stream

log = logging.getLogger(__name__)

DENSE_SOURCE = KERNELS_ROOT / "model" / "dense.cu"
#: threads of dense_rmsnorm_f16 (DENSE_NORM_THREADS in dense.cu; the twin depends on it)
NORM_THREADS = 256
WARP = 32
GEMM_IMPLS = ("cublas", "own")
#: bytes the "own" GEMM keeps in front of its fp32 scratch (the row bounds)
OWN_BOUNDS_BYTES = 256
EPILOGUE_THREADS = 256
EPILOGUE_MAX_BLOCKS = 4096


class DenseError(StrataError):
    """A dense launch was asked for a shape, address or workspace it cannot take."""


def own_workspace_bytes(max_rows: int, max_n_out: int) -> int:
    """The workspace the "own" GEMM needs for fp16 or accumulated outputs of up to max_rows x
    max_n_out (plain fp32 outputs, such as the logits, are written directly and need none:
    size it for the q/k/v and o projections)."""
    return OWN_BOUNDS_BYTES + 4 * max_rows * max_n_out


def workspace_bytes(gemm_impl: str, max_rows: int, max_n_out: int) -> int:
    """Workspace to give DenseKernels: cuBLAS's recommended size, or what the "own" GEMM needs
    for fp16 or accumulated outputs of up to max_rows x max_n_out."""
    _check_impl(gemm_impl)
    return WORKSPACE_BYTES if gemm_impl == "cublas" else own_workspace_bytes(max_rows,
                                                                              max_n_out)


def _check_impl(gemm_impl: str) -> None:
    if gemm_impl not in GEMM_IMPLS:
        raise DenseError(f"dense GEMM implementation {gemm_impl!r}; allowed: "
                         f"{', '.join(GEMM_IMPLS)}")


class DenseKernels:
    """Prepared launches of the dense kernels on one runtime.

    `workspace` (device address, `workspace_bytes` long, 256-byte aligned) belongs to the GEMM:
    cuBLAS's workspace ("cublas"), or the row bounds and fp32 scratch of "own"; it must not be
    used by anything else while launches run."""

    def __init__(self, rt: Runtime, workspace: int, workspace_bytes: int,
                 gemm_impl: str = "cublas"):
        _check_impl(gemm_impl)
        self.gemm_impl = gemm_impl
        self.workspace, self.workspace_bytes = workspace, workspace_bytes
        mod = rt.module(DENSE_SOURCE)
        self._norm = mod.kernel("dense_rmsnorm_f16", "PPPiif", overlap=True)
        self.cublas: Cublas | None = None
        self._grouped: GroupedGemm | None = None
        if gemm_impl == "cublas":
            self.cublas = Cublas(workspace, workspace_bytes, owner=rt)
            log.info("dense GEMM: cuBLAS %d.%d.%d", *self.cublas.version)
        else:
            if workspace % 256 or workspace_bytes < OWN_BOUNDS_BYTES:
                raise DenseError(f"own dense GEMM workspace at 0x{workspace:x} of "
                                 f"{workspace_bytes} bytes: want 256-byte alignment and at "
                                 f"least {OWN_BOUNDS_BYTES} bytes")
            self._grouped = GroupedGemm(rt, iq3_gather=False)
            self._bounds = mod.kernel("dense_set_bounds", "Pi")
            self._epilogue = mod.kernel("dense_epilogue", "PPqi")

    # ------------------------------------------------------------------ RMSNorm
    def rmsnorm_f16(self, stream: Stream, x: int, w: int, out: int, rows: int, hidden: int,
                    eps: float, row_stride: int | None = None) -> None:
        """out[r] = fp16(RMSNorm(x[r]) * w) for r < rows: x float32 rows `row_stride` floats
        apart (default hidden), w float32 [hidden], out fp16 [rows, hidden]. Bytes equal
        rmsnorm_f16_reference."""
        stride = hidden if row_stride is None else row_stride
        if rows <= 0 or hidden <= 0 or stride < hidden:
            raise DenseError(f"rmsnorm of {rows} rows of {hidden} values, row stride {stride}: "
                             "rows and hidden must be positive and the stride >= hidden")
        if rows > 2**31 - 1:
            raise DenseError(f"rmsnorm of {rows} rows: at most 2**31 - 1 in one launch")
        self._norm.launch(grid=(rows, 1, 1), block=(NORM_THREADS, 1, 1), stream=stream,
                          args=(x, w, out, hidden, stride, float(eps)))

    # ------------------------------------------------------------------ GEMM
    def gemm(self, stream: Stream, x: int, w: int, out: int, rows: int, n_out: int, k: int,
             out_f32: bool, accumulate: bool) -> None:
        """out[rows, n_out] (= or +=) x[rows, k] . w[n_out, k]^T; x, w fp16 row-major, fp32
        accumulation, out fp32 (out_f32) or fp16; accumulate (fp32 out only) adds into out."""
        if self.cublas is not None:
            self.cublas.gemm(stream, x, w, out, rows, n_out, k, out_f32, accumulate)
        else:
            self._own_gemm(stream, x, w, out, rows, n_out, k, out_f32, accumulate)

    def _own_gemm(self, stream: Stream, x: int, w: int, out: int, rows: int, n_out: int,
                  k: int, out_f32: bool, accumulate: bool) -> None:
        if accumulate and not out_f32:
            raise DenseError("gemm: accumulate=True adds into an fp32 output; an fp16 output "
                             "can only be written (out_f32=True to accumulate)")
        if rows <= 0 or n_out <= 0 or n_out % TILE_N or k <= 0 or k % K_MULTIPLE:
            raise DenseError(f"own dense GEMM of {rows} x {k} by {n_out} x {k}: needs rows > 0, "
                             f"n_out a multiple of {TILE_N} and k a multiple of {K_MULTIPLE} "
                             "(STRATA_DENSE_GEMM=cublas takes any shape)")
        direct = out_f32 and not accumulate
        need = OWN_BOUNDS_BYTES + (0 if direct else 4 * rows * n_out)
        if need > self.workspace_bytes:
            raise DenseError(f"own dense GEMM of {rows} x {n_out} outputs needs a workspace of "
                             f"{need} bytes, given {self.workspace_bytes} "
                             "(size it with own_workspace_bytes)")
        check_aligned({"x": x, "w": w, "out": out})
        bounds = self.workspace
        scratch = self.workspace + OWN_BOUNDS_BYTES
        self._bounds.launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream,
                            args=(bounds, rows))
        assert self._grouped is not None
        self._grouped.gemm(stream, w, (0,), x, bounds, out if direct else scratch, n_out, k,
                           rows)
        if not direct:
            n = rows * n_out
            blocks = max(1, min(EPILOGUE_MAX_BLOCKS, -(-n // EPILOGUE_THREADS)))
            self._epilogue.launch(grid=(blocks, 1, 1), block=(EPILOGUE_THREADS, 1, 1),
                                  stream=stream, args=(scratch, out, n, 1 if accumulate else 0))

    # ------------------------------------------------------------------ output head
    def logits(self, stream: Stream, x: int, first_row: int, norm_w: int, w_out: int,
               y_f16_scratch: int, out_f32: int, rows: int, hidden: int, vocab: int,
               eps: float) -> None:
        """out_f32[r] = fp16(RMSNorm(x[first_row + r]) * norm_w) . w_out^T for r < rows, as
        float32 [rows, vocab]; w_out fp16 [vocab, hidden], y_f16_scratch fp16 [rows, hidden].
        The last position of a chunk of T: first_row = T - 1, rows = 1; all: 0, T."""
        if first_row < 0:
            raise DenseError(f"logits from row {first_row}: the first row must be >= 0")
        self.rmsnorm_f16(stream, x + 4 * first_row * hidden, norm_w, y_f16_scratch, rows,
                         hidden, eps)
        self.gemm(stream, y_f16_scratch, w_out, out_f32, rows, vocab, hidden, True, False)


# ---------------------------------------------------------------------------- numpy twins
def _butterfly(v: np.ndarray) -> np.ndarray:
    """Lane 0 of the xor butterfly over the last axis (32 lanes), in v's dtype."""
    lanes = np.arange(WARP)
    for o in (16, 8, 4, 2, 1):
        v = v + v[..., lanes ^ o]
    return v[..., 0]


def rmsnorm_f16_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The bytes dense_rmsnorm_f16 writes for float32 rows x [rows, hidden] and float32 w."""
    x = np.asarray(x, dtype=np.float32)
    w = np.asarray(w, dtype=np.float32)
    if x.ndim != 2 or w.shape != (x.shape[1],):
        raise DenseError(f"rmsnorm twin: x must be [rows, hidden] and w [hidden], got "
                         f"{x.shape} and {w.shape}")
    rows, hidden = x.shape
    per = -(-hidden // NORM_THREADS)
    sq = np.zeros((rows, per * NORM_THREADS), dtype=np.float32)
    sq[:, :hidden] = x * x  # rounded squares; the padding adds exact zeros
    sq = sq.reshape(rows, per, NORM_THREADS)
    part = np.zeros((rows, NORM_THREADS), dtype=np.float32)
    for j in range(per):  # each thread's ascending columns
        part = part + sq[:, j]
    warp_sums = _butterfly(part.reshape(rows, NORM_THREADS // WARP, WARP))
    padded = np.zeros((rows, WARP), dtype=np.float32)
    padded[:, : NORM_THREADS // WARP] = warp_sums
    ss = _butterfly(padded)
    mean = ss / np.float32(hidden)
    inv = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return ((x * inv[:, None]) * w).astype(np.float16)


def gemm_reference(x: np.ndarray, w: np.ndarray, out_f32: bool = True,
                   into: np.ndarray | None = None) -> np.ndarray:
    """float64 product x . w^T of fp16 x [rows, k] and w [n_out, k], rounded once: to float32
    (out_f32), to float16, or added to the float32 `into` in float64 and then rounded."""
    if x.dtype != np.float16 or w.dtype != np.float16 or x.ndim != 2 or w.ndim != 2 \
            or x.shape[1] != w.shape[1]:
        raise DenseError(f"gemm twin: x and w must be float16 [rows, k] and [n_out, k], got "
                         f"{x.dtype} {x.shape} and {w.dtype} {w.shape}")
    prod = x.astype(np.float64) @ w.astype(np.float64).T
    if into is not None:
        return (np.asarray(into, dtype=np.float64) + prod).astype(np.float32)
    return prod.astype(np.float32 if out_f32 else np.float16)


def logits_reference(x: np.ndarray, first_row: int, rows: int, norm_w: np.ndarray,
                     w_out: np.ndarray, eps: float) -> np.ndarray:
    """DenseKernels.logits in numpy: the kernel's exact RMSNorm, then the float64 product."""
    y = rmsnorm_f16_reference(x[first_row: first_row + rows], norm_w, eps)
    return gemm_reference(y, w_out)
