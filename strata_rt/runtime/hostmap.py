"""Device addresses of page-locked host memory, for kernels that read it over PCIe.

A decode step replayed as a CUDA graph cannot enqueue copies of experts it only learns about
on the device; its gathers read those experts straight from the pinned host store instead.
Under unified addressing the driver maps page-locked allocations into the device's address
space; cuMemHostGetDevicePointer names the address (pycuda has no call for an arbitrary
pointer inside an allocation, so this goes through the driver API with ctypes). The input
gate (strata_rt.runtime.gate) names its word the same way."""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import StrataError
from .driver_api import libcuda


def host_device_pointer(host: np.ndarray) -> int:
    """The device address of host[0] (host: page-locked memory of the current context)."""
    address = ctypes.c_ulonglong()
    code = libcuda().cuMemHostGetDevicePointer_v2(ctypes.byref(address),
                                                  ctypes.c_void_p(host.ctypes.data), 0)
    if code != 0:
        raise StrataError(f"cuMemHostGetDevicePointer failed (CUDA error {code}): the host "
                          "store is not page-locked memory the device can map")
    return int(address.value)
