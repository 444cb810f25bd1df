"""The CUDA driver API calls pycuda does not offer, loaded once through ctypes: graph capture
and replay (strata_rt.runtime.graph), conditional graph nodes (conditional), device addresses
of pinned host memory (hostmap), stream memory operations (gate) and page-locking memory this
process mapped itself (host_arena). pycuda's context is current on the calling thread, so
these calls act in it."""

from __future__ import annotations

import ctypes
import functools

from ..errors import StrataError

_vp, _u64, _u32 = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint
#: name -> argument types; every call returns a CUresult
_SIGNATURES: dict[str, list[type]] = {
    "cuStreamBeginCapture_v2": [_vp, ctypes.c_int],
    "cuStreamEndCapture": [_vp, ctypes.POINTER(_vp)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_vp), _vp, _u64],
    "cuGraphLaunch": [_vp, _vp],
    "cuGraphUpload": [_vp, _vp],
    "cuGraphExecDestroy": [_vp],
    "cuGraphDestroy": [_vp],
    "cuStreamIsCapturing": [_vp, ctypes.POINTER(ctypes.c_int)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(_u64), _vp, _u32],
    # stream, device address of a 32-bit word, value, flags
    "cuStreamWaitValue32_v2": [_vp, _u64, _u32, _u32],
    "cuStreamWriteValue32_v2": [_vp, _u64, _u32, _u32],
    # conditional copies (runtime/conditional.py)
    "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuStreamGetCaptureInfo_v3": [_vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_u64),
                                  ctypes.POINTER(_vp), ctypes.POINTER(ctypes.POINTER(_vp)),
                                  _vp, ctypes.POINTER(ctypes.c_size_t)],
    "cuStreamUpdateCaptureDependencies_v2": [_vp, ctypes.POINTER(_vp), _vp, ctypes.c_size_t,
                                             _u32],
    "cuStreamBeginCaptureToGraph": [_vp, _vp, _vp, _vp, ctypes.c_size_t, ctypes.c_int],
    "cuGraphConditionalHandleCreate": [ctypes.POINTER(_u64), _vp, _vp, _u32, _u32],
    "cuGraphAddNode_v2": [ctypes.POINTER(_vp), _vp, ctypes.POINTER(_vp), _vp, ctypes.c_size_t,
                          _vp],
    "cuMemcpyHtoDAsync_v2": [_u64, _vp, ctypes.c_size_t, _vp],
    # page-locking memory this process mapped itself (runtime/host_arena.py)
    "cuMemHostRegister_v2": [_vp, ctypes.c_size_t, _u32],
    "cuMemHostUnregister": [_vp],
}


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    """libcuda with the argument and result types of the calls above set."""
    lib = ctypes.CDLL("libcuda.so.1")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:  # a newer driver's call (conditional nodes, 12.3+): its users check
            continue    # the driver's version first (runtime/conditional.py)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def error_text(code: int) -> str:
    """"CUDA error N (the driver's words for it)"."""
    text = ctypes.c_char_p()
    libcuda().cuGetErrorString(code, ctypes.byref(text))
    msg = text.value.decode() if text.value else "unknown error"
    return f"CUDA error {code} ({msg})"


def check_call(code: int, call: str) -> None:
    """Raises StrataError naming `call` and the CUDA error when `code` is not success."""
    if code != 0:
        raise StrataError(f"{call} failed: {error_text(code)}")
