"""Overlapped kernel launches: cuLaunchKernelEx with programmatic stream serialization, which
pycuda does not offer.

A launch marked this way may start while the grid before it on the stream is finishing: its
blocks become resident and wait in the kernel (kernels/common/prior_grid.cuh's
wait_prior_grid) rather than behind a full launch gap. Only kernels that call wait_prior_grid
before touching global memory may be launched so; the order of their reads and writes is then
the ordinary stream order. Inside a stream capture the driver records a programmatic edge, so
a replayed graph overlaps the same way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .driver_api import check_call, libcuda

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
_PROGRAMMATIC_SERIALIZATION = 6
#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h)
_MAX_DYNAMIC_SHARED = 8
#: argument codes of runtime/module.py's Kernel -> the ctypes type of one argument
_CTYPES: dict[str, Any] = {"P": ctypes.c_uint64, "i": ctypes.c_int32, "I": ctypes.c_uint32,
           "f": ctypes.c_float, "d": ctypes.c_double, "q": ctypes.c_int64}


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: the id, padding to 8 bytes, then a 64-byte value union whose first
    # int is programmaticStreamSerializationAllowed
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("n_attrs", ctypes.c_uint)]


def _bind() -> ctypes.CDLL:
    lib = libcuda()
    for name, args in {
        "cuModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
        "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                ctypes.c_char_p],
        "cuModuleUnload": [ctypes.c_void_p],
        "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
        "cuLaunchKernelEx": [ctypes.POINTER(_Config), ctypes.c_void_p,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


class OverlapModule:
    """A second load of a module's cubin through the driver API, whose function handles
    cuLaunchKernelEx takes (pycuda does not expose its own). Loaded in the current context;
    `free` unloads it."""

    def __init__(self, cubin: Path):
        self._lib = _bind()
        handle = ctypes.c_void_p()
        self._image = cubin.read_bytes()  # the driver may read the image while it loads
        check_call(self._lib.cuModuleLoadData(ctypes.byref(handle), self._image),
                   f"cuModuleLoadData({cubin.name})")
        self.handle = handle

    def function(self, name: str) -> OverlapFunction:
        f = ctypes.c_void_p()
        check_call(self._lib.cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                   f"cuModuleGetFunction({name})")
        return OverlapFunction(self._lib, f, name)

    def free(self) -> None:
        if self.handle:
            self._lib.cuModuleUnload(self.handle)
            self.handle = ctypes.c_void_p()


class OverlapFunction:
    """One kernel launched with programmatic stream serialization."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, name: str):
        self._lib = lib
        self.handle = handle
        self.name = name
        self._attr = _Attribute(id=_PROGRAMMATIC_SERIALIZATION, value=1)

    def allow_shared(self, nbytes: int) -> None:
        """Opts this handle into `nbytes` of dynamic shared memory (the pycuda handle of the
        same kernel is another object with its own attribute)."""
        check_call(self._lib.cuFuncSetAttribute(self.handle, _MAX_DYNAMIC_SHARED, nbytes),
                   f"cuFuncSetAttribute({self.name})")

    def launch(self, grid: Sequence[int], block: Sequence[int], stream: int, arg_types: str,
               args: Sequence, shared: int) -> None:
        values: list[Any] = [_CTYPES[c](float(a)) if c in "fd" else _CTYPES[c](int(a))
                             for c, a in zip(arg_types, args, strict=True)]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        cfg = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared,
                      ctypes.c_void_p(stream), ctypes.pointer(self._attr), 1)
        check_call(self._lib.cuLaunchKernelEx(ctypes.byref(cfg), self.handle, params, None),
                   f"cuLaunchKernelEx({self.name})")
