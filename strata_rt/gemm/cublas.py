"""cuBLAS through ctypes: the dense projections and the output head as one fp16 GEMM call each.

Why cuBLAS and not a kernel of ours: the dense weights are plain fp16 matrices with no
quantized format to fuse, and cuBLAS's GEMMs are the reference speed for exactly that shape on
every architecture. Why ctypes: the toolkit's library is all that is needed (no torch, no
cupy), and the project already drives the CUDA driver API the same way (runtime/graph.py).

Nothing is loaded when this module is imported: the library is looked up the first time a
`Cublas` is created (or `library()` / `version()` is called), so CPU-only machines import it
freely. A missing library is a CublasError naming every path tried.

Capture safety: the handle gets a workspace the caller allocated (cublasSetWorkspace), so
cuBLAS never allocates while a CUDA graph is being captured; the stream is set whenever a call
names another one (and the workspace again right after, since cublasSetStream resets it), so
one handle serves any stream; scalars are host values (pointer mode host).

Determinism: cuBLAS gives the same bytes run after run for the same shapes, stream-ordered on
the same GPU model and library version; it does not promise that a row's result is
independent of how many rows the call has (its kernel and split-K choice depend on the
shape), so chunking a prompt differently may change bytes. strata_rt.backends.cuda.dense.kernels
offers a batch-invariant alternative (STRATA_DENSE_GEMM=own).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StrataError

if TYPE_CHECKING:
    from ..runtime.context import DriverContext
    from ..runtime.streams import Stream

log = logging.getLogger(__name__)

#: sonames tried, newest first (13 ships with CUDA 13, 12 with CUDA 12)
SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")
#: the workspace cuBLAS recommends on Hopper (4 MiB suffices before it); 256-byte aligned
WORKSPACE_BYTES = 32 << 20
WORKSPACE_ALIGN = 256

# values from cublas_api.h and library_types.h (CUDA 12 and 13 agree on all of them)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_DEFAULT_MATH = 0
#: split-K reductions of an fp16 output stay in fp32 instead of rounding partial sums to fp16
CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUDA_R_32F, CUDA_R_16F = 0, 2
#: libraryPropertyType
MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL = 0, 1, 2


class CublasError(StrataError):
    """libcublas cannot be found or loaded, or a cuBLAS call failed."""


def candidate_paths() -> list[str]:
    """Where libcublas is looked for, in order: the loader's own search by soname (what is
    already loaded, LD_LIBRARY_PATH, ldconfig), ctypes.util's find_library, then each soname in
    $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64 and the lib folders of NVIDIA's
    pip packages (nvidia/cu13/lib for CUDA 13, nvidia/cublas/lib for CUDA 12)."""
    paths: list[str] = list(SONAMES)
    found = ctypes.util.find_library("cublas")
    if found and found not in paths:
        paths.append(found)
    folders = [Path(os.environ[v]) / "lib64" for v in ("CUDA_HOME", "CUDA_PATH")
               if os.environ.get(v)]
    folders.append(Path("/usr/local/cuda/lib64"))
    folders.extend(_pip_folders())
    for folder in folders:
        paths.extend(str(folder / name) for name in SONAMES)
    return list(dict.fromkeys(paths))


def _pip_folders() -> list[Path]:
    """lib folders of the `nvidia` namespace package (pip's nvidia-cublas wheels); the spec is
    looked up without importing anything."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(root) / sub / "lib" for root in spec.submodule_search_locations
            for sub in ("cu13", "cublas")]


def _open(paths: list[str]) -> ctypes.CDLL:
    """The first path that loads; libcublasLt of the same folder is loaded first so a cuBLAS
    outside the loader's path finds its companion."""
    tried = []
    for path in paths:
        if os.sep in path and not Path(path).exists():
            tried.append(f"{path} (absent)")
            continue
        if os.sep in path:
            lt = Path(path).with_name(Path(path).name.replace("libcublas", "libcublasLt"))
            if lt.exists():
                try:
                    ctypes.CDLL(str(lt), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass  # the load of libcublas itself reports what is wrong
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        log.debug("cuBLAS loaded from %s", path)
        return lib
    listing = "\n".join(f"  - {t}" for t in tried)
    raise CublasError(
        "libcublas could not be loaded; tried:\n" + listing + "\nInstall the CUDA toolkit's "
        "cuBLAS (or `pip install nvidia-cublas`), or put its lib folder on LD_LIBRARY_PATH or "
        "in CUDA_HOME/lib64")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """libcublas with the signatures strata_rt calls (cublas_api.h), loaded once."""
    lib = _open(candidate_paths())
    vp, i32, p_i32 = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    for name, argtypes in (
        ("cublasCreate_v2", [ctypes.POINTER(vp)]),
        ("cublasDestroy_v2", [vp]),
        ("cublasGetProperty", [i32, p_i32]),
        ("cublasSetStream_v2", [vp, vp]),
        ("cublasSetWorkspace_v2", [vp, vp, ctypes.c_size_t]),
        ("cublasSetPointerMode_v2", [vp, i32]),
        ("cublasSetMathMode", [vp, i32]),
        # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
        # ldc, computeType, algo
        ("cublasGemmEx", [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp,
                          i32, i32, i32, i32]),
    ):
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.cublasGetStatusString.argtypes = [ctypes.c_int]
    lib.cublasGetStatusString.restype = ctypes.c_char_p
    return lib


def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded libcublas."""
    lib, out = library(), []
    for prop in (MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL):
        value = ctypes.c_int()
        _check(lib.cublasGetProperty(prop, ctypes.byref(value)), "cublasGetProperty")
        out.append(value.value)
    return out[0], out[1], out[2]


def _check(status: int, call: str) -> None:
    if status != 0:
        text = library().cublasGetStatusString(status)
        raise CublasError(f"{call} failed: cuBLAS status {status} "
                          f"({text.decode() if text else 'unknown'})")


class Cublas:
    """One cuBLAS handle in the CUDA context current at creation (a Runtime's).

    `workspace` is a device buffer of `workspace_bytes` (WORKSPACE_BYTES recommended, 256-byte
    aligned) that stays alive as long as the handle; `owner` (a Runtime) destroys the handle
    before its context dies."""

    def __init__(self, workspace: int, workspace_bytes: int, owner: DriverContext | None = None):
        if workspace % WORKSPACE_ALIGN or workspace_bytes < 0:
            raise CublasError(f"cuBLAS workspace at 0x{workspace:x} of {workspace_bytes} bytes: "
                              f"it must start on a {WORKSPACE_ALIGN}-byte boundary")
        lib = library()
        handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)),
               "cublasCreate (is a CUDA context current?)")
        self._handle: ctypes.c_void_p | None = handle
        self._workspace, self._workspace_bytes = workspace, workspace_bytes
        self._stream: int | None = None  # the stream last set (None: not yet)
        try:
            self._set_workspace()
            _check(lib.cublasSetPointerMode_v2(handle, CUBLAS_POINTER_MODE_HOST),
                   "cublasSetPointerMode")
            _check(lib.cublasSetMathMode(
                handle, CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION),
                "cublasSetMathMode")
        except CublasError:
            self.destroy()
            raise
        self.version = version()
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        if owner is not None:
            owner._own(self)

    def _set_workspace(self) -> None:
        _check(library().cublasSetWorkspace_v2(self._handle,
                                               ctypes.c_void_p(self._workspace or None),
                                               self._workspace_bytes), "cublasSetWorkspace")

    def gemm(self, stream: Stream, x: int, w: int, out: int, rows: int, n_out: int, k: int,
             out_f32: bool, accumulate: bool) -> None:
        """out[rows, n_out] (= or +=) x[rows, k] . w[n_out, k]^T on `stream`.

        x and w are fp16 row-major, the products accumulate in fp32 (CUBLAS_COMPUTE_32F), out
        is fp32 (out_f32) or fp16 row-major; accumulate adds into out (beta = 1, fp32 out only).

        cuBLAS is column-major: a row-major [r, c] matrix is the column-major [c, r] matrix
        with leading dimension c, i.e. its transpose. So row-major out [rows, n_out] is
        column-major out^T [n_out, rows] (ldc = n_out), and out^T = w . x^T, where w row-major
        [n_out, k] is column-major [k, n_out] (lda = k) taken with op T -> [n_out, k], and x
        row-major [rows, k] is column-major x^T [k, rows] (ldb = k) taken as is (op N). Hence
        GemmEx(T, N, m = n_out, n = rows, k, A = w, B = x, C = out)."""
        if self._handle is None:
            raise CublasError("cuBLAS handle used after destroy()")
        if accumulate and not out_f32:
            raise CublasError("gemm: accumulate=True adds into an fp32 output; an fp16 output "
                              "can only be written (out_f32=True to accumulate)")
        if min(rows, n_out, k) <= 0:
            raise CublasError(f"gemm of {rows} x {k} by {n_out} x {k}: every dimension must "
                              "be positive")
        lib = library()
        if stream.handle != self._stream:
            # cublasSetStream resets the handle to cuBLAS's own workspace pool (which may
            # allocate, even inside a graph capture): ours is set again right after it
            _check(lib.cublasSetStream_v2(self._handle, ctypes.c_void_p(stream.handle or None)),
                   "cublasSetStream")
            self._set_workspace()
            self._stream = stream.handle
        c_type = CUDA_R_32F if out_f32 else CUDA_R_16F
        beta = self._one if accumulate else self._zero
        _check(lib.cublasGemmEx(
            self._handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, rows, k, ctypes.byref(self._one),
            ctypes.c_void_p(w), CUDA_R_16F, k, ctypes.c_void_p(x), CUDA_R_16F, k,
            ctypes.byref(beta), ctypes.c_void_p(out), c_type, n_out, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT), f"cublasGemmEx ({rows} x {k} by {n_out} x {k})")

    def destroy(self) -> None:
        """Releases the handle (the workspace stays the caller's)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            _check(library().cublasDestroy_v2(handle), "cublasDestroy")

    #: a Runtime frees what it owns through `free()` before its context dies
    free = destroy
